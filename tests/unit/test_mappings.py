"""Mapping ops: each direction inverts the other, and TP sharding matches megatron-core's layout."""

import pytest
import torch

from megatron_patch.models.mappings import QKV, GatedMLP, Replicated, RowParallel, Shapes, VocabParallel

S = Shapes(num_heads=8, num_query_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)


def test_qkv_layout_is_grouped_interleave():
    # q rows tagged 0..31 (head h -> rows 4h..4h+3), k rows 100.., v rows 200..
    q = torch.arange(32.0).unsqueeze(1)
    k = 100 + torch.arange(8.0).unsqueeze(1)
    v = 200 + torch.arange(8.0).unsqueeze(1)
    m = QKV("q", "k", "v", "qkv")
    full = m.to_megatron([q, k, v], S).squeeze(1).tolist()
    # group 0: q heads 0-3, k head 0, v head 0; then group 1
    expected = list(range(16)) + [100, 101, 102, 103] + [200, 201, 202, 203]
    expected += list(range(16, 32)) + [104, 105, 106, 107] + [204, 205, 206, 207]
    assert full == expected
    # TP=2: each rank holds one whole group
    shards = m.shard(torch.tensor(full).unsqueeze(1), 2, S)
    assert shards[0].squeeze(1).tolist() == expected[:24]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_op_round_trips_bitwise(tp):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cases = [
        (QKV("q", "k", "v", "x"), [r(32, 6), r(8, 6), r(8, 6)]),
        (QKV("q", "k", "v", "x"), [r(32), r(8), r(8)]),
        (GatedMLP("g", "u", "x"), [r(12, 6), r(12, 6)]),
        (RowParallel("o", "x"), [r(6, 32)]),
        (VocabParallel("e", "x"), [r(10, 6)]),
        (Replicated("n", "x"), [r(6)]),
    ]
    for m, hf in cases:
        shards = m.shard(m.to_megatron(hf, S), tp, S)
        assert len(shards) == tp
        back = m.to_hf(m.unshard(shards, S), S)
        assert all(torch.equal(a, b) for a, b in zip(hf, back)), type(m).__name__


def test_gated_mlp_rank_holds_gate_and_up_shards():
    gate, up = torch.zeros(4, 1), torch.ones(4, 1)
    shards = GatedMLP("g", "u", "x").shard(torch.cat([gate, up]), 2, S)
    assert shards[0].squeeze(1).tolist() == [0, 0, 1, 1]


def test_vocab_padding_rows_are_zero_and_removed_on_export():
    m = VocabParallel("e", "x")
    full = m.to_megatron([torch.ones(10, 3)], S)
    assert full.shape == (16, 3) and full[10:].abs().sum() == 0
    assert m.to_hf(full, S)[0].shape == (10, 3)
    with pytest.raises(ValueError, match="vocab_size"):
        m.to_megatron([torch.ones(11, 3)], S)


def test_replicated_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differs"):
        Replicated("n", "x").unshard([torch.zeros(2), torch.ones(2)], S)
