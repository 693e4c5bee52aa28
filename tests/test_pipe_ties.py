"""Tie and boundary rules (see sampling.pipe.kernels), on exact dyadic probabilities.

top-k keeps exactly k tokens, the lower ids among equal values; top-p keeps a
token iff the mass strictly before it is < top_p; min-p keeps p >= min_p * max;
a uniform u picks the token t with before(t) <= u * M < before(t) + p(t), in
the order (descending probability, lower id first). Every rule is checked on
the plain op, the fused op, the whole-vocabulary paths (radix select and
pivot search) and the candidate path.
"""

from __future__ import annotations

import pytest
import torch

from sampling.pipe import SAMPLED, LogitsPipe, MinP, Sample, Softmax, Tap, TensorType, TopK, TopP
from sampling.pipe import kernels as K

PROBS = TensorType.PROBS


def _support(pipe: LogitsPipe, x: torch.Tensor, **params) -> list[list[int]]:
    """The tokens each row may be sampled from, read off the "sampled" tap."""
    seen = []
    pipe.sample(x, u=torch.zeros(x.shape[0], dtype=torch.float64), taps=[Tap(SAMPLED, seen.append)], **params)
    return [row.nonzero().flatten().tolist() for row in seen[0].data]


def _pipes(*stages, **kw):
    """The pipe compiled and not, with each algorithm (the sync-free ones forced on CPU tensors)."""
    return [
        LogitsPipe(list(stages), compile=c, algorithm=a, **kw)
        for c in (True, False)
        for a in ("cpu", "sort", "radix", "pivot")
    ]


def _wide(probs: list[float], vocab: int) -> torch.Tensor:
    """``probs`` padded with zeros to ``vocab`` tokens (to reach the whole-vocabulary paths)."""
    x = torch.zeros(1, vocab)
    x[0, : len(probs)] = torch.tensor(probs)
    return x


@pytest.mark.parametrize("vocab", [8, K.SORT_BELOW + 8])
def test_top_k_keeps_exactly_k_with_lower_ids_among_ties(vocab):
    logits = torch.full((2, vocab), float("-inf"))
    logits[0, :6] = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0])
    logits[1, :6] = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    for algorithm in ("cpu", "sort"):
        plain = LogitsPipe([TopK()], compile=False, algorithm=algorithm)
        kept = plain(logits, top_k=3) > float("-inf")
        assert kept[0].nonzero().flatten().tolist() == [1, 2, 3]
        assert kept[1].nonzero().flatten().tolist() == [0, 1, 2]
        kept = plain(logits, top_k=torch.tensor([2, 4]), max_top_k=4) > float("-inf")
        assert kept[0].nonzero().flatten().tolist() == [1, 3]
        assert kept[1].nonzero().flatten().tolist() == [0, 1, 2, 3]
    for pipe in _pipes(TopK(), Sample()):
        assert _support(pipe, logits, top_k=3) == [[1, 2, 3], [0, 1, 2]]
        assert _support(pipe, logits, top_k=torch.tensor([2, 4])) == [[1, 3], [0, 1, 2, 3]]


def test_top_k_ties_are_resolved_against_tokens_outside_topk_s_choice():
    """torch.topk may return any of tied tokens; the kept ones must be the lowest ids anyway."""
    logits = torch.zeros(1, 5000)
    logits[0, 4000:] = 1.0  # 1000 tokens tied at the top
    for pipe in _pipes(TopK(), Sample()):
        assert _support(pipe, logits, top_k=7) == [[4000, 4001, 4002, 4003, 4004, 4005, 4006]]


@pytest.mark.parametrize("vocab", [4, K.SORT_BELOW + 4])
def test_top_p_drops_a_token_whose_preceding_mass_equals_top_p(vocab):
    x = _wide([0.5, 0.25, 0.125, 0.125], vocab)
    for pipe in _pipes(TopP(), Sample(), input_type=PROBS):
        assert _support(pipe, x, top_p=0.75) == [[0, 1]]
        assert _support(pipe, x, top_p=0.7501) == [[0, 1, 2]]
        assert _support(pipe, x, top_p=0.5) == [[0]]
        assert _support(pipe, x, top_p=1.0) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("vocab", [6, K.SORT_BELOW + 6])
def test_top_p_among_equal_probabilities_keeps_lower_ids(vocab):
    x = _wide([0.0625, 0.25, 0.1875, 0.25, 0.25, 0.0], vocab)
    for pipe in _pipes(TopP(), Sample(), input_type=PROBS):
        assert _support(pipe, x, top_p=0.5) == [[1, 3]]  # before(4) = 0.5 is not < 0.5
        assert _support(pipe, x, top_p=0.6) == [[1, 3, 4]]


@pytest.mark.parametrize("vocab", [4, K.SORT_BELOW + 4])
def test_min_p_keeps_a_token_exactly_at_the_threshold(vocab):
    x = _wide([0.5, 0.25, 0.125, 0.125], vocab)
    for pipe in _pipes(MinP(), Sample(), input_type=PROBS):
        assert _support(pipe, x, min_p=0.25) == [[0, 1, 2, 3]]
        assert _support(pipe, x, min_p=0.5) == [[0, 1]]
        assert _support(pipe, x, min_p=1.0) == [[0]]


@pytest.mark.parametrize("vocab", [4, K.SORT_BELOW + 4])
def test_a_uniform_on_a_cdf_boundary_picks_the_next_token(vocab):
    x = _wide([0.25, 0.5, 0.125, 0.125], vocab).expand(6, -1).contiguous()
    u = torch.tensor([0.0, 0.4999, 0.5, 0.75, 0.8, 0.99999], dtype=torch.float64)
    # order: 1 (0.5), 0 (0.25), 2 (0.125), 3 (0.125); boundaries at 0.5, 0.75, 0.875
    expected = [1, 1, 0, 2, 2, 3]
    for stages, params in (([Sample()], {}), ([TopP(), Sample()], {"top_p": 1.0}), ([TopK(), Sample()], {"top_k": 4})):
        for pipe in _pipes(*stages, input_type=PROBS):
            assert pipe(x, u=u, **params).tolist() == expected, pipe


def test_a_uniform_inside_the_top_p_set_maps_to_the_renormalised_cdf():
    x = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    u = torch.tensor([0.0, 2 / 3 - 1e-9, 2 / 3, 0.99], dtype=torch.float64)
    for pipe in _pipes(TopP(), Sample(), input_type=PROBS):
        # kept {0: 2/3, 1: 1/3}
        assert pipe(x.expand(4, -1), u=u, top_p=0.75).tolist() == [0, 0, 1, 1]


def test_sampling_order_among_ties_is_by_id():
    x = torch.full((4, 8), 0.125)
    u = torch.tensor([0.0, 0.13, 0.5, 0.99], dtype=torch.float64)
    for pipe in _pipes(Softmax(), Sample()):
        assert pipe(x, u=u).tolist() == [0, 1, 4, 7]


def test_greedy_cases_of_the_filters():
    """top_k 1 and a tiny top_p both leave only the arg-max (lowest id among ties)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    u = torch.rand(50, dtype=torch.float64)
    for pipe in _pipes(Softmax(), TopK(), Sample()):
        assert set(pipe(logits.expand(50, -1), u=u, top_k=1).tolist()) == {1}
    for pipe in _pipes(Softmax(), TopP(), Sample()):
        assert set(pipe(logits.expand(50, -1), u=u, top_p=1e-6).tolist()) == {1}
