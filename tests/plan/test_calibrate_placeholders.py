"""`router.init: calibrate`: every kind that calibrates plans its routers as placeholders (a
random router until fitted on the written model), and `--dry-run` says so."""

import pytest

from plan.fakes import fake, plan_from_headers

CALIBRATE = {"router": {"init": "calibrate"}, "calibration": {"data": "text.txt"}}
EXPERTS = [{"model": "e1", "name": "code"}, {"model": "e2", "name": "math"}]
RECIPES = {
    "token_routed": {"kind": "moe", "base_model": "base", "experts": EXPERTS},
    "seq_routed": {"kind": "moe", "assembly": "seq_routed", "base_model": "base",
                   "experts": EXPERTS},
    "merged_experts": {"kind": "moe", "assembly": "merged_experts", "base_model": "base",
                       "experts": EXPERTS},
}


@pytest.mark.parametrize("kind", list(RECIPES))
def test_calibrated_routers_are_planned_as_placeholders_and_described_so(kind):
    checkpoints = {n: fake("llama") for n in ("base", "e1", "e2")}
    plan, _ = plan_from_headers({**RECIPES[kind], **CALIBRATE}, checkpoints)
    routers = [job for job in plan.jobs if job.role == "router"]
    assert routers and all(job.router_init == "calibrate" for job in routers)
    assert all(plan.describe_job(job).endswith("(a placeholder here: fitted on the written "
                                               "model)") for job in routers)
    uncalibrated, _ = plan_from_headers(RECIPES[kind], checkpoints)
    assert not any("placeholder" in uncalibrated.describe_job(job) for job in uncalibrated.jobs)
