"""Manifest comparison and dtype names (no processes)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engines.weight_sync.errors import ManifestMismatchError
from engines.weight_sync.formats.manifest import Manifest, dtype_name, mismatches, raise_problems


def check_manifest(
    expected: Manifest, got: Manifest, *, engine: str = "engine", allow_partial: bool = False
) -> None:
    """Raise ManifestMismatchError naming the first differences."""
    raise_problems(engine, mismatches(expected, got, allow_partial=allow_partial))


def manifest(**shapes) -> Manifest:
    return Manifest.of((name, torch.zeros(*shape)) for name, shape in shapes.items())


def test_equal_manifests_have_no_mismatch():
    m = manifest(w=(2, 3), b=(3,))
    assert mismatches(m, m) == []
    check_manifest(m, m)


def test_each_kind_of_mismatch_names_the_parameter():
    engine = manifest(w=(2, 3), b=(3,), k=(4,))
    trainer = Manifest.of(
        [
            ("w", torch.zeros(3, 2)),
            ("b", torch.zeros(3, dtype=torch.bfloat16)),
            ("x", torch.zeros(1)),
        ]
    )
    problems = mismatches(engine, trainer)
    assert problems == [
        "'w': shape [3, 2] from the trainer, [2, 3] on the engine",
        "'b': dtype bfloat16 from the trainer, float32 on the engine",
        "'x': the engine has no such parameter",
        "the trainer does not send 'k'",
    ]
    with pytest.raises(
        ManifestMismatchError, match="engine-7: weight manifest mismatch: 'w': shape"
    ):
        check_manifest(engine, trainer, engine="engine-7")


def test_a_resized_vocabulary_is_named_with_both_row_counts():
    engine = manifest(**{"model.embed_tokens.weight": (10, 4), "lm_head.weight": (10, 4)})
    trainer = manifest(**{"model.embed_tokens.weight": (12, 4), "lm_head.weight": (10, 5)})
    embed, head = mismatches(engine, trainer)
    assert embed.startswith(
        "'model.embed_tokens.weight': the trainer sends 12 vocabulary rows, the engine holds 10"
    )
    assert "create the engines from that checkpoint" in embed
    # Not a vocabulary resize (another hidden size): the plain shape message.
    assert head == "'lm_head.weight': shape [10, 5] from the trainer, [10, 4] on the engine"


def test_partial_manifest_only_when_allowed():
    engine = manifest(w=(2,), b=(3,))
    trainer = manifest(w=(2,))
    assert mismatches(engine, trainer, allow_partial=True) == []
    assert mismatches(engine, trainer) == ["the trainer does not send 'b'"]


def test_duplicate_names_and_bad_dtypes_are_rejected():
    with pytest.raises(ValidationError, match="'w' appears twice"):
        Manifest.of([("w", torch.zeros(1)), ("w", torch.zeros(1))])
    with pytest.raises(ValueError, match="'floaty' is not a torch dtype"):
        dtype_name("floaty")
    assert dtype_name(torch.bfloat16) == dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name("float") == "float32"
