"""Per-model parameters (one value per model) and signed weights in the tensor functions,
computed by hand on tiny tensors; the row-block path agrees with the one-piece merge."""

import pytest
import torch

from moemerge.merge.dispatch import merge

BASE = torch.zeros(4)
A = torch.tensor([4.0, -3.0, 2.0, 1.0])
B = torch.tensor([1.0, 2.0, 3.0, 4.0])

pytestmark = pytest.mark.usefixtures("torch_code")  # the torch row-block path


def test_ties_trims_each_model_at_its_own_density():
    # A at 0.5 keeps [4, -3, 0, 0]; B at 0.25 keeps [0, 0, 0, 4]; the votes [4, -3, 0, 4]
    out = merge("ties", base=BASE, tensors=[A, B], density=[0.5, 0.25])
    assert out.tolist() == [4.0, -3.0, 0.0, 4.0]
    # one density for both: B keeps 3 as well, so the per-model value changed the output
    assert merge("ties", base=BASE, tensors=[A, B], density=0.5).tolist() == [4.0, -3.0, 3.0,
                                                                               4.0]


def test_a_model_at_density_1_keeps_its_whole_task_vector():
    # dare_linear with B's weight 0: the output is A's task vector, undropped at density 1
    out = merge("dare_linear", base=BASE, tensors=[A, B], weights=[1.0, 0.0],
                density=[1.0, 0.5], normalize=False)
    assert torch.equal(out, A)


def test_breadcrumbs_per_model_density_and_gamma():
    # n = 4. A: density 0.5, gamma 0.25: keep 2, drop int(0.25·4) = 1 outlier (4) -> [0, -3, 2, 0]
    # B: density 0.75, gamma 0: keep the 3 largest -> [0, 2, 3, 4]
    out = merge("breadcrumbs", base=BASE, tensors=[A, B], density=[0.5, 0.75],
                gamma=[0.25, 0.0], normalize=False)
    assert out.tolist() == [0.0, -1.0, 5.0, 4.0]


def test_della_per_model_epsilon_reaches_each_model():
    # density 1 for A keeps it whole whatever its epsilon; B's drop uses its own values
    out = merge("della_linear", base=BASE, tensors=[A, B], weights=[1.0, 0.0],
                density=[1.0, 0.5], epsilon=[0.3, 0.1], normalize=False)
    assert torch.equal(out, A)


@pytest.mark.parametrize("method, extra", [
    ("ties", {}), ("breadcrumbs", {"gamma": [0.01, 0.1, 0.0]}),
    ("breadcrumbs_ties", {"gamma": 0.02}),
])
def test_row_blocks_agree_with_one_piece_at_per_model_densities(method, extra):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 16, generator=g)
    tensors = [base + torch.randn(64, 16, generator=g) for _ in range(3)]
    kwargs = {"density": [0.3, 1.0, 0.8], **extra}
    whole = merge(method, base=base, tensors=tensors, **kwargs)
    blocked = merge(method, base=base, tensors=tensors, block=160, **kwargs)  # 10 rows a block
    assert torch.equal(whole, blocked)


def test_negative_weight_subtracts_a_task_vector():
    # task arithmetic, unnormalised: base + 1 · τ_A − 1 · τ_B
    base = torch.tensor([1.0, 1.0])
    a, b = torch.tensor([3.0, 1.0]), torch.tensor([2.0, 0.0])
    out = merge("task_arithmetic", base=base, tensors=[a, b], weights=[1.0, -1.0],
                normalize=False)
    assert out.tolist() == [2.0, 2.0]  # τ_A = [2, 0], τ_B = [1, −1]: 1 + [1, 1]
    # normalised, the weights must still sum above 0: [2, −1] / 1, so 1 + 2 τ_A − τ_B
    out = merge("task_arithmetic", base=base, tensors=[a, b], weights=[2.0, -1.0])
    assert out.tolist() == [4.0, 2.0]


def test_average_without_normalize_is_the_weighted_sum():
    a, b = torch.tensor([3.0, 1.0]), torch.tensor([2.0, 0.0])
    assert merge("average", base=None, tensors=[a, b], weights=[2.0, -1.0],
                 normalize=False).tolist() == [4.0, 2.0]
    assert merge("average", base=None, tensors=[a, b], weights=[1.0, 3.0]).tolist() == [2.25,
                                                                                        0.25]


def test_passthrough_scales_its_one_tensor():
    assert merge("passthrough", base=None, tensors=[A], scale=0.5).tolist() == [2.0, -1.5, 1.0,
                                                                                0.5]


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "ties", "lambda": [1.0, 2.0]}, "lambda takes one value for all models"),
    ({"method": "ties", "density": [0.5]}, "1 per-model value for 2 models"),
    ({"method": "ties", "density": [0.5, 0.0]}, r"density must be in \(0, 1\]"),
    ({"method": "dare_ties", "weights": [1.0, -0.5]}, "dare_ties takes no negative weight"),
    ({"method": "multislerp", "weights": [1.0, -0.5]}, "multislerp takes no negative weight"),
])
def test_refused(kwargs, message):
    args = {"base": torch.zeros(2), "tensors": [torch.zeros(2), torch.ones(2)], **kwargs}
    with pytest.raises(ValueError, match=message):
        merge(args.pop("method"), **args)
