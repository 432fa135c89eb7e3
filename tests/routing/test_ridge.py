"""The closed-form router fit: ridge against torch.linalg.lstsq, λ chosen on held-out rows,
the decisive scale, and the targets."""

import pytest
import torch

from moemerge.routing.calibrate import domain_targets, loss_targets
from moemerge.routing.ridge import (
    MAX_FITTED_CONFIDENCE,
    RELATIVE_LAMBDAS,
    centre,
    decisive_scale,
    fit_router,
    fitted_scale,
    normal_equations,
    ridge_solution,
    squared_error,
)


def system(rows=300, hidden=16, experts=3, noise=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(hidden, experts, generator=gen, dtype=torch.float64)
    return x, x @ w + noise * torch.randn(rows, experts, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("lam", [0.0, 0.3, 50.0])
def test_ridge_equals_lstsq_of_the_augmented_system(lam):
    """argmin ‖XW − Y‖² + λ‖W‖² is the least-squares solution of [X; √λ I] W = [Y; 0]."""
    x, y = system(noise=0.5)
    ours = ridge_solution(normal_equations(x, y), lam)
    augmented = torch.cat([x, lam ** 0.5 * torch.eye(x.shape[1], dtype=torch.float64)])
    target = torch.cat([y, torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)])
    theirs = torch.linalg.lstsq(augmented, target).solution
    assert (ours - theirs).abs().max() < 1e-10
    # and the comparison can fail: another λ is another solution
    assert (ridge_solution(normal_equations(x, y), lam + 5.0) - theirs).abs().max() > 1e-3


def test_squared_error_from_normal_equations_is_the_direct_one():
    x, y = system(noise=1.0)
    w = torch.randn(16, 3, dtype=torch.float64)
    assert squared_error(normal_equations(x, y), w) == pytest.approx(
        float(((x @ w - y) ** 2).sum()), rel=1e-9)


def test_fit_router_returns_rows_on_centred_targets_and_picks_lambda_on_held_out_rows():
    """Noiseless targets: the smallest λ fits best; few noisy rows: a larger one does. The
    returned router is [E, H], fitted on the targets minus each row's mean over experts."""
    held = torch.arange(300) % 5 == 4
    x, y = system()
    w, lam = fit_router(x, y, held)
    scale = float((x.T @ x).diagonal().mean())
    assert w.shape == (3, 16)
    assert lam == pytest.approx(RELATIVE_LAMBDAS[0] * scale)
    assert torch.allclose(x @ w.T, centre(y), atol=1e-5)
    x, y = system(rows=30, noise=20.0, seed=1)
    _, noisy = fit_router(x, y, torch.arange(30) % 5 == 4)
    assert noisy > 1e3 * RELATIVE_LAMBDAS[0] * float((x.T @ x).diagonal().mean())


@pytest.mark.parametrize("confidence", [0.6, 0.8, 0.95])
def test_decisive_scale_reaches_the_mean_top1_probability(confidence):
    logits = torch.randn(500, 4, generator=torch.Generator().manual_seed(3))
    c = decisive_scale(logits, confidence)
    top1 = torch.softmax(c * logits.double(), -1).amax(-1).mean()
    assert float(top1) == pytest.approx(confidence, abs=1e-6)


def cross_entropy(c: float, logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The plain reference: mean −Σ_e y_e log softmax(c z)_e."""
    return float(-(targets.double() * torch.log_softmax(c * logits.double(), -1)).sum(-1).mean())


@pytest.mark.parametrize("true_scale", [0.3, 1.0, 4.0])
def test_fitted_scale_recovers_the_scale_that_made_soft_targets(true_scale):
    """Targets softmax(c* z): the cross-entropy is least at c = c* (Gibbs), so the fit must
    find c* whatever it is."""
    logits = torch.randn(400, 4, generator=torch.Generator().manual_seed(1))
    targets = torch.softmax(true_scale * logits.double(), -1)
    assert fitted_scale(logits, targets) == pytest.approx(true_scale, rel=1e-6)


def test_fitted_scale_is_the_cross_entropy_minimum_of_a_plain_grid_search():
    """Noisy one-hot targets (each row's argmax logit right 70 % of the time): the fitted
    scale's cross-entropy is the least of a fine grid, and the grid's neighbours are worse
    (the comparison can fail)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(600, 3, generator=gen)
    right = torch.rand(600, generator=gen) < 0.7
    label = torch.where(right, logits.argmax(-1), torch.randint(0, 3, (600,), generator=gen))
    targets = torch.nn.functional.one_hot(label, 3).double()
    c = fitted_scale(logits, targets)
    grid = [10 ** (p / 200) for p in range(-400, 401)]
    best = min(grid, key=lambda g: cross_entropy(g, logits, targets))
    assert c == pytest.approx(best, rel=0.02)
    assert cross_entropy(c, logits, targets) <= cross_entropy(best, logits, targets) + 1e-9
    assert cross_entropy(2 * c, logits, targets) > cross_entropy(c, logits, targets) + 1e-3
    assert cross_entropy(c / 2, logits, targets) > cross_entropy(c, logits, targets) + 1e-3


def test_fitted_scale_is_bounded_for_separable_and_useless_rows():
    """Rows whose targets are always the top logit would take c to infinity: capped where the
    mean top-1 probability is MAX_FITTED_CONFIDENCE. Targets that oppose the logits: the low
    end, near-uniform routing."""
    logits = torch.randn(300, 4, generator=torch.Generator().manual_seed(4))
    right = torch.nn.functional.one_hot(logits.argmax(-1), 4).double()
    c = fitted_scale(logits, right)
    top1 = float(torch.softmax(c * logits.double(), -1).amax(-1).mean())
    assert top1 == pytest.approx(MAX_FITTED_CONFIDENCE, abs=1e-6)
    wrong = torch.nn.functional.one_hot(logits.argmin(-1), 4).double()
    c = fitted_scale(logits, wrong)
    assert float(torch.softmax(c * logits.double(), -1).amax(-1).mean()) < 0.26


def test_fitted_scale_weights_rows_as_repeats():
    """weights [N] stand for repeated rows: the same fit as the rows repeated."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, 3, generator=gen)
    targets = torch.softmax(torch.randn(50, 3, generator=gen).double(), -1)
    repeats = torch.randint(1, 4, (50,), generator=gen)
    weighted = fitted_scale(logits, targets, weights=repeats.double())
    repeated = fitted_scale(logits.repeat_interleave(repeats, 0),
                            targets.repeat_interleave(repeats, 0))
    assert weighted == pytest.approx(repeated, rel=1e-9)
    assert fitted_scale(logits, targets) != pytest.approx(repeated, rel=1e-3)


def test_targets():
    one_hot = domain_targets(torch.tensor([1, 0]), expert_of=[2, 0], num_experts=3, seq_len=4)
    assert one_hot.shape == (2, 4, 3)
    assert one_hot[0, :, 0].eq(1).all() and one_hot[1, :, 2].eq(1).all()
    nll = torch.tensor([[[1.0, 5.0]], [[3.0, 1.0]]])  # [E=2, W=1, S=2]
    soft = loss_targets(nll)
    assert soft.shape == (1, 2, 2)
    assert torch.allclose(soft.sum(-1), torch.ones(1, 2))
    assert soft[0, 0].argmax() == 0 and soft[0, 1].argmax() == 1  # the lower loss wins
    assert float(soft[0, 0, 0]) == pytest.approx(1 / (1 + torch.e ** -2))
