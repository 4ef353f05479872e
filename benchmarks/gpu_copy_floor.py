"""The copies of a 7B CUDA IPC sync, without the sync: how fast a GPU copies
a Llama-3-8B-shaped model (291 bf16 tensors, 14.48 GB) into vLLM's fused
layout (q/k/v and gate/up stacked), against one flat copy of the same bytes.

    python3 benchmarks/gpu_copy_floor.py      # one GPU, torch only (no vLLM, no Ray)

Each way of copying is timed (median of 5) in this process, then again in a
child process that opens the source tensors by CUDA IPC handle, as an engine
does: `copy_` per tensor, those copies as one CUDA graph, `_foreach_copy_`,
and its graph.
"""

import time

import torch
import torch.multiprocessing as mp

H, MLP, L, V, KV = 4096, 14336, 32, 32000, 1024


def shapes():
    s = [("embed", (V, H))]
    for layer in range(L):
        s += [
            (f"{layer}.q", (H, H)),
            (f"{layer}.k", (KV, H)),
            (f"{layer}.v", (KV, H)),
            (f"{layer}.o", (H, H)),
            (f"{layer}.gate", (MLP, H)),
            (f"{layer}.up", (MLP, H)),
            (f"{layer}.down", (H, MLP)),
            (f"{layer}.ln1", (H,)),
            (f"{layer}.ln2", (H,)),
        ]
    s += [("norm", (H,)), ("lm_head", (V, H))]
    return s


def dests(dev):
    """vLLM-like fused parameters, and the destination view of each source."""
    views = []
    keep = []

    def new(shape):
        t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        keep.append(t)
        return t

    views.append(new((V, H)))
    for _ in range(L):
        qkv = new((H + 2 * KV, H))
        gu = new((2 * MLP, H))
        views += [qkv[:H], qkv[H : H + KV], qkv[H + KV :], new((H, H))]
        views += [gu[:MLP], gu[MLP:], new((H, MLP)), new((H,)), new((H,))]
    views += [new((H,)), new((V, H))]
    return views, keep


def timeit(fn, n=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        s = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - s)
    return sorted(ts)[len(ts) // 2] * 1e3


def graph_of(fn):
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(st)
    return g


def run_copies(tag, srcs, dsts):
    nbytes = sum(t.numel() * 2 for t in srcs)

    def eager():
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s, non_blocking=True)

    def foreach():
        torch._foreach_copy_(dsts, srcs)

    g1 = graph_of(eager)
    g2 = graph_of(foreach)
    ways = [
        ("eager copy_", eager),
        ("graph of copy_", g1.replay),
        ("foreach_copy_", foreach),
        ("graph of foreach", g2.replay),
    ]
    for name, fn in ways:
        ms = timeit(fn)
        print(f"{tag:8} {name:18} {ms:7.2f} ms  {nbytes / ms / 1e9:6.2f} TB/s", flush=True)


def child(q):
    dev = torch.device("cuda", 0)
    srcs = list(q.get())
    dsts, keep = dests(dev)
    run_copies("ipc", srcs, dsts)
    flat = q.get()
    out = torch.empty_like(flat)
    ms = timeit(lambda: out.copy_(flat))
    rate = flat.numel() / ms / 1e9
    print(f"ipc      flat copy          {ms:7.2f} ms  {rate:6.2f} TB/s", flush=True)
    q.put("done")


if __name__ == "__main__":
    dev = torch.device("cuda", 0)
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    srcs = [torch.randn(s, dtype=torch.bfloat16, device=dev) for _, s in shapes()]
    nbytes = sum(t.numel() * 2 for t in srcs)
    print(f"{len(srcs)} tensors, {nbytes / 1e9:.2f} GB", flush=True)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = torch.empty_like(flat)
    ms = timeit(lambda: out.copy_(flat))
    print(f"local    flat copy          {ms:7.2f} ms  {nbytes / ms / 1e9:6.2f} TB/s", flush=True)
    del out
    dsts, keep = dests(dev)
    run_copies("local", srcs, dsts)
    del dsts, keep
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    q.put(srcs)
    q.put(flat)
    time.sleep(1)
    p.join(timeout=240)
    print("child exit", p.exitcode)
