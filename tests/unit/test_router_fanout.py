"""The fan-out's per-sample requests (router_svc/fanout.py) and the sample counts (validation)."""

import pytest

from protos import common_pb2
from router_svc.errors import RouterError
from router_svc.fanout import pd_request, sample_seed
from router_svc.validation import MAX_SAMPLES, PreparedRequest, sample_counts


def _prep(**sampling) -> PreparedRequest:
    return PreparedRequest(request_id="r", input_ids=[1, 2], sampling=common_pb2.SamplingParams(**sampling),
                           stop=[], tenant="t", n=3, best_of=3)


def test_sample_seeds_are_seed_plus_index_modulo_2_64():
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    top = 2**64 - 1
    assert sample_seed(top, 1) == 0          # still a uint64: SamplingParams.seed takes it


def test_pd_request_is_one_request_of_best_of_samples_and_leaves_the_parent():
    parent = _prep(seed=5)
    pd = pd_request(parent, logprobs=True)
    assert (pd.request_id, pd.n, pd.best_of) == ("r", 3, 3)
    assert pd.sampling.logprobs and pd.sampling.seed == 5     # P and D derive each sample's seed
    assert not parent.sampling.logprobs
    assert pd_request(parent) is parent


def test_sample_counts():
    assert sample_counts(0, 0) == (1, 1)
    assert sample_counts(3, 0) == (3, 3)
    assert sample_counts(2, 5) == (2, 5)
    for n, best_of, param in ((MAX_SAMPLES + 1, 0, "n"), (3, 2, "best_of"), (1, MAX_SAMPLES + 1, "best_of")):
        with pytest.raises(RouterError) as e:
            sample_counts(n, best_of)
        assert e.value.param == param
