"""Weight sync into real engines: local Ray, the tiny model, the CPU backend,
the reference policy actor as trainer, and outside trainer processes.

The tests share one set of engines (starting them is most of the time);
each begins with the engines brought in line with the policy (`setup`), so
none depends on what another left behind or on the order they run in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from policy_probes import create_probed_policy
from test_group import listening_addresses
from waiting import SETUP_TIMEOUT_S

from engines import (
    EngineStaleError,
    SamplingParams,
    create_vllm_engines,
    destroy_engines,
    replace_engine,
)
from engines.client import get
from engines.errors import EngineDeadError
from engines.weight_sync import (
    BroadcastSender,
    ChecksumMismatchError,
    ManifestMismatchError,
    SyncConfig,
    sync_from_checkpoint,
)
from engines.weight_sync.formats.manifest import Manifest

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
PREFIX = "test-wsync"
# Fixed sequences whose per-token logprobs engines and trainer must agree on.
SEQUENCES = [list(range(5, 45)), [7, 99, 3, 250, 18, 64, 64, 12], list(range(200, 212))]
# Engines (left-padded batch, KV cache) and trainer (right-padded forward) run
# the same float32 model through different kernels and paddings; measured
# differences are ~1e-6.
LOGPROB_ATOL = 1e-4
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_local_module):
    engines = create_vllm_engines(
        2, tiny_model, max_len=256, gpu_memory_utilization=0.5, backend="hf", name_prefix=PREFIX
    )
    policy = create_probed_policy(
        {"pretrain": tiny_model, "sync_timeout_s": TIMEOUT_S, "bucket_bytes": 64 * 1024}
    )
    ray.get([e.ready.remote() for e in engines] + [policy.health.remote()], timeout=SETUP_TIMEOUT_S)
    get(policy.init_weight_sync.remote(engines), 60)
    yield engines, policy
    ray.kill(policy)
    destroy_engines(engines)


@pytest.fixture
def setup(cluster):
    """The shared engines and policy, the engines serving the policy's weights
    (a full sync at a new version, whatever the last test left)."""
    engines, policy = cluster
    get(policy.perturb.remote(0.0, 0), 30)
    get(policy.sync_weights.remote(engines), 60)
    return engines, policy


def engine_logprobs(engine) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = get(engine.generate.remote(SEQUENCES, params), 60)
    return [
        [
            step[token].logprob
            for step, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
        ]
        for o in outputs
    ]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def health(engines) -> list[dict]:
    return [get(e.health.remote(), 30) for e in engines]


def engine_weights(engine, names) -> dict[str, torch.Tensor]:
    return get(engine.read_weights.remote(names), 30)


def assert_weights(engines, expected: dict[str, torch.Tensor]) -> None:
    for engine in engines:
        got = engine_weights(engine, list(expected))
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name


def policy_weights(policy) -> dict[str, torch.Tensor]:
    names = [n for n, _ in get(policy.named_weights.remote(), 30)]
    return get(policy.read_weights.remote(names), 30)


def ray_address() -> tuple[str, str]:
    context = ray.get_runtime_context()
    return context.gcs_address, context.namespace


def run_peer(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # The peer imports this checkout's code, as the engines do (Ray gives
    # them the driver's working directory), not an installed copy.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_settled(engines, deadline_s: float) -> tuple[list[dict], float]:
    """Poll until no engine is paused (the failed sync has been closed)."""
    started = time.monotonic()
    while True:
        states = health(engines)
        if not any(s["paused"] for s in states):
            return states, time.monotonic() - started
        if time.monotonic() - started > deadline_s:
            raise AssertionError(f"engines still paused after {deadline_s}s: {states}")
        time.sleep(0.2)


def test_sync_makes_engines_match_the_trainer(setup):
    engines, policy = setup
    # In line with the policy (the fixture synced them).
    assert (
        max_diff(engine_logprobs(engines[0]), get(policy.sequence_logprobs.remote(SEQUENCES), 30))
        < LOGPROB_ATOL
    )
    version = get(policy.perturb.remote(0.02, 1), 30)
    trainer = get(policy.sequence_logprobs.remote(SEQUENCES), 30)
    before = [engine_logprobs(e) for e in engines]
    assert all(max_diff(b, trainer) > 1e-3 for b in before)

    report = get(policy.sync_weights.remote(), 60)

    assert report.version == version and report.verified and not report.skipped
    assert report.bytes == sum(t.numel() * 4 for t in policy_weights(policy).values())
    assert report.buckets > 1 and report.gb_per_s > 0
    # Where the time went inside the engines, within the phases that hold it.
    inside = report.engine_times
    assert set(inside) == {"pause_s", "prepare_s", "wait_s", "load_s"}
    assert inside["pause_s"] + inside["prepare_s"] <= report.phases["begin"]
    assert 0 < inside["wait_s"] + inside["load_s"] <= report.phases["transfer"]
    for engine in engines:
        assert max_diff(engine_logprobs(engine), trainer) < LOGPROB_ATOL
    assert_weights(engines, policy_weights(policy))
    assert [(h["weight_version"], h["stale"], h["paused"]) for h in health(engines)] == [
        (version, False, False)
    ] * 2
    out = get(engines[1].generate.remote([5, 6, 7], SamplingParams(max_tokens=2)), 30)
    assert out.weight_version == version
    # Nothing new: nothing to send.
    assert get(policy.sync_weights.remote(), 60).skipped


def test_manifest_mismatch_changes_nothing(setup):
    engines, policy = setup
    before_version = health(engines)[0]["weight_version"]
    weights = policy_weights(policy)
    good = Manifest.of(weights.items())
    bad = Manifest.of(
        [(n, t.T if n == "model.layers.1.mlp.down_proj.weight" else t) for n, t in weights.items()]
    ).model_dump(mode="json")

    for engine in engines:
        with pytest.raises(
            ManifestMismatchError, match="'model.layers.1.mlp.down_proj.weight': shape"
        ):
            get(engine.begin_weight_sync.remote(before_version + 1, bad), 30)
        with pytest.raises(ManifestMismatchError, match="does not send 'lm_head.weight'"):
            get(
                engine.check_weight_manifest.remote(
                    Manifest(params=good.params[:-1]).model_dump(mode="json")
                ),
                30,
            )
    assert [(h["weight_version"], h["stale"], h["paused"]) for h in health(engines)] == [
        (before_version, False, False)
    ] * 2
    assert_weights(engines, weights)
    # And the next sync is not blocked by a half-open one.
    get(policy.perturb.remote(0.01, 2), 30)
    assert get(policy.sync_weights.remote(), 60).version == before_version + 1


def test_trainer_killed_mid_sync_engines_restore_old_weights(setup):
    engines, policy = setup
    old = policy_weights(policy)
    old_version = health(engines)[0]["weight_version"]
    gcs, namespace = ray_address()
    started = time.monotonic()
    result = run_peer("dying_trainer.py", gcs, namespace, ",".join(engines.names), "3")
    assert result.returncode == 17, result.stdout + result.stderr
    assert "sent 3 of" in result.stdout

    states, waited = wait_settled(engines, TIMEOUT_S + 10)
    # The engines noticed within the collective deadline (gloo sees the closed
    # sockets at once; the deadline bounds the hung-peer case).
    assert waited < TIMEOUT_S + 5, f"took {waited:.1f}s after the trainer died"
    assert [(s["weight_version"], s["stale"]) for s in states] == [(old_version, False)] * 2
    assert_weights(engines, old)
    out = get(engines[0].generate.remote([1, 2, 3], SamplingParams(max_tokens=2)), 30)
    assert out.weight_version == old_version
    assert time.monotonic() - started < 120


def test_openrlhf_trainer_in_another_process_updates_the_engines(setup, tiny_model, tmp_path):
    engines, policy = setup
    old_version = health(engines)[0]["weight_version"]
    gcs, namespace = ray_address()
    out = tmp_path / "sent.pt"
    result = run_peer(
        "openrlhf_trainer.py", gcs, namespace, ",".join(engines.names), tiny_model, str(out)
    )
    assert result.returncode == 0, result.stdout + result.stderr

    sent = torch.load(out)
    assert_weights(engines, sent)
    assert [(h["weight_version"], h["stale"], h["paused"]) for h in health(engines)] == [
        (old_version + 1, False, False)
    ] * 2
    out_ = get(engines[0].generate.remote([1, 2, 3], SamplingParams(max_tokens=2)), 30)
    assert out_.weight_version == old_version + 1


def test_a_stranger_at_the_rendezvous_neither_joins_nor_corrupts_a_sync(setup):
    """A process that is not part of the run reaches the weight group's port
    (on loopback: engines and trainer share this node) while a sync runs: it
    reads only sealed keys, its claim of rank 1 is never answered, and the
    engines get the trainer's weights, checksums verified."""
    engines, policy = setup
    old = policy_weights(policy)
    version = health(engines)[0]["weight_version"] + 1
    sender = BroadcastSender(SyncConfig(bucket_bytes=16 * 1024, timeout_s=TIMEOUT_S))
    info = sender.init(engines)
    stranger = None
    try:
        assert info.master_address == "127.0.0.1"
        assert listening_addresses(info.master_port) == ["127.0.0.1"]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        stranger = subprocess.Popen(
            [sys.executable, str(HERE / "stranger.py"), "127.0.0.1", str(info.master_port)]
            + [info.group_name, str(info.world_size), "1", "64", "5"],
            env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert stranger.stdout.readline().strip() == "connected"
        assert stranger.stdout.readline().startswith("read ")
        new = {n: t + 0.25 for n, t in old.items()}
        report = sender.sync(list(new.items()), version)
        out, err = stranger.communicate(timeout=60)
    finally:
        sender.close()
        if stranger is not None:
            stranger.kill()
            stranger.wait()
    assert report.verified and report.version == version
    assert_weights(engines, new)
    assert out.splitlines()[-1].startswith("refused:"), (out, err)
    assert "joined" not in out


def test_openrlhf_trainer_killed_mid_sync_leaves_engines_stale(setup, tiny_model, tmp_path):
    engines, policy = setup
    gcs, namespace = ray_address()
    result = run_peer(
        "openrlhf_trainer.py",
        gcs,
        namespace,
        ",".join(engines.names),
        tiny_model,
        str(tmp_path / "sent.pt"),
        "--die-after",
        "5",
    )
    assert result.returncode == 17, result.stdout + result.stderr

    states, waited = wait_settled(engines, TIMEOUT_S + 10)
    assert waited < TIMEOUT_S + 5, f"took {waited:.1f}s after the trainer died"
    # Five parameters of the new weights are in: the engines refuse work
    # rather than serve the mix.
    assert all(s["stale"] for s in states)
    with pytest.raises(EngineStaleError, match="stale weights"):
        get(engines[0].generate.remote([1, 2, 3], SamplingParams(max_tokens=2)), 30)

    # The engines left the policy's group for the outside trainer's (now
    # torn down): the policy's next sync sees that and rebuilds its group.
    get(policy.perturb.remote(0.01, 3), 30)
    report = get(policy.sync_weights.remote(), 60)
    assert not report.skipped
    assert [s["stale"] for s in health(engines)] == [False, False]
    assert_weights(engines, policy_weights(policy))


def test_checkpoint_transport(setup, tmp_path):
    engines, policy = setup
    version = get(policy.perturb.remote(0.01, 4), 30)
    path = get(policy.save_checkpoint.remote(str(tmp_path / "ckpt")), 60)
    report = sync_from_checkpoint(engines, path, config=SyncConfig(timeout_s=30))
    assert report.version == version and report.verified
    assert_weights(engines, policy_weights(policy))
    assert [h["weight_version"] for h in health(engines)] == [version] * 2


def test_the_policy_syncs_through_a_checkpoint_directory(setup, tmp_path):
    """The trainer's checkpoint transport (`CheckpointSender`, no special case
    in the trainer): each sync writes v<version> under the directory and the
    engines load it, verified."""
    engines, policy = setup
    options = dict(transport="checkpoint", checkpoint_dir=str(tmp_path))
    info = get(policy.init_weight_sync.remote(engines, **options), 60)
    try:
        assert info == {"transport": "checkpoint", "engines": 2}
        version = get(policy.perturb.remote(0.01, 6), 30)
        report = get(policy.sync_weights.remote(), 60)
        assert (report.transport, report.version, report.verified) == ("checkpoint", version, True)
        assert (tmp_path / f"v{version:06d}" / "model.safetensors").is_file()
        assert_weights(engines, policy_weights(policy))
    finally:
        get(policy.init_weight_sync.remote(engines), 60)  # back to the broadcast


def test_one_engine_with_nothing_to_verify_syncs_in_one_call(setup, tmp_path):
    engines, policy = setup
    version = get(policy.perturb.remote(0.01, 5), 30)
    path = get(policy.save_checkpoint.remote(str(tmp_path / "ckpt")), 60)
    config = SyncConfig(timeout_s=30, verify=False)
    # One engine: begin, load and commit in one call (no finish phase).
    report = sync_from_checkpoint(engines[:1], path, config=config)
    assert set(report.phases) == {"transfer"}
    assert [h["weight_version"] for h in health(engines)] == [version, version - 1]
    # Two engines: the commit waits until both have loaded (a second call).
    report = sync_from_checkpoint(engines, path, config=config)
    assert set(report.phases) == {"transfer", "finish"}
    assert [h["weight_version"] for h in health(engines)] == [version] * 2
    assert_weights(engines, policy_weights(policy))


class FlipsAByte:
    """The trainer's weight group, flipping one byte of the second bucket on
    its way out: a transfer that arrives corrupted."""

    def __init__(self, group):
        self.group = group
        self.sent = 0

    def start_broadcast(self, tensor, src=0):
        self.sent += 1
        if self.sent == 2:
            tensor[7] ^= 1
        return self.group.start_broadcast(tensor, src)

    def __getattr__(self, name):
        return getattr(self.group, name)


def test_a_corrupted_bucket_aborts_the_sync_on_every_engine(setup):
    engines, policy = setup
    old = policy_weights(policy)
    old_version = health(engines)[0]["weight_version"]
    sender = BroadcastSender(
        SyncConfig(bucket_bytes=16 * 1024, timeout_s=TIMEOUT_S, on_failure="restore")
    )
    sender.init(engines)
    sender.group = FlipsAByte(sender.group)
    try:
        with pytest.raises(ChecksumMismatchError, match=r"1 of \d+ checksums differ.*'bucket-1'"):
            sender.sync([(n, t + 0.5) for n, t in old.items()], old_version + 1)
    finally:
        sender.close()
    # Both engines restored the old weights and serve the old version.
    assert [(h["weight_version"], h["stale"], h["paused"]) for h in health(engines)] == [
        (old_version, False, False)
    ] * 2
    assert_weights(engines, old)


def test_engine_killed_mid_sync(setup):
    """It kills an engine. The trainer's sync fails within the deadline
    naming the dead engine; the survivor restores its weights; the replaced
    engine is brought in line by the next sync."""
    engines, policy = setup
    old = policy_weights(policy)
    old_version = health(engines)[0]["weight_version"]
    weights = [(n, t + 0.5) for n, t in old.items()]
    sender = BroadcastSender(
        SyncConfig(bucket_bytes=16 * 1024, timeout_s=TIMEOUT_S, on_failure="restore")
    )
    sender.init(engines)
    transfer = sender.start(weights, old_version + 1)
    transfer.send(2)
    ray.kill(engines[1], no_restart=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=engines.names[1]):
        transfer.send()
        transfer.finish()
    assert time.monotonic() - started < TIMEOUT_S + 5
    (state,) = health(engines[:1])
    assert (state["weight_version"], state["stale"], state["paused"]) == (old_version, False, False)
    assert_weights(engines[:1], old)
    sender.close()

    # The flow replaces the dead engine (same name and bundle, fresh weights
    # of version 0) and passes the new set to the next sync: the policy
    # reconnects and brings both engines to its version.
    replace_engine(engines, 1)
    get(engines[1].ready.remote(), 120)
    report = get(policy.sync_weights.remote(engines), 60)
    assert not report.skipped
    assert [(h["weight_version"], h["stale"]) for h in health(engines)] == [
        (report.version, False)
    ] * 2
    assert_weights(engines, policy_weights(policy))
