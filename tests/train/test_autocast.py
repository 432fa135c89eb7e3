"""finetune's mixed-precision path (bf16 autocast, the default on CUDA) run on the CPU: the
same code, `--autocast bf16`, on every kind. No GPU here, so this is where that path is proven."""

import pytest
import torch
from test_gradient_checkpointing import IDS, KINDS, built_model

from moemerge.train import loop
from moemerge.train.distributed import Dist, setup


def _ctx(dtype):
    return Dist(0, 1, 0, torch.device("cpu"), autocast=dtype)


def test_setup_chooses_autocast_by_device():
    assert setup("cpu").autocast is None  # fp32 on the CPU unless asked
    assert setup("cpu", autocast="bf16").autocast == torch.bfloat16
    assert setup("cpu", autocast="off").autocast is None


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_forward_and_float32_gradients(kind, model_factory, tmp_path):
    model = built_model(kind, model_factory, tmp_path)
    block = torch.cat([IDS, IDS[:, :1]], dim=1)  # [b, T + 1]
    seen = []  # output dtypes of the linear layers inside the forward
    hooks = [m.register_forward_hook(lambda _m, _i, o: seen.append(o.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    results = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)  # DARE-CA draws its expert mask in training
        model.zero_grad()
        seen.clear()
        total, lm = loop._loss(model, block, 0.0, _ctx(dtype))
        total.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads and all(g.dtype == torch.float32 and g.isfinite().all()
                             for g in grads.values())
        results[name] = (lm, set(seen))
    for h in hooks:
        h.remove()
    assert results["fp32"][1] == {torch.float32}
    assert results["bf16"][1] == {torch.bfloat16}  # every projection ran in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights untouched
    fp32, bf16 = results["fp32"][0], results["bf16"][0]
    assert bf16 != fp32 and abs(bf16 - fp32) < 0.02 * fp32  # bf16 rounding, not another model
