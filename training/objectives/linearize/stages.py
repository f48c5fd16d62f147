"""The linearize objective's stage schedule: the stage is a function of the step (configs/train.yaml linearize.*),
so a checkpoint resumes inside any stage."""
STAGES = ("transfer", "distill", "finetune")


def stage_at(step: int, lc) -> str:
    """The stage of the step that follows `step` steps done (lc: the linearize config)."""
    if step < lc.transfer_steps:
        return "transfer"
    return "distill" if step < lc.transfer_steps + lc.distill_steps else "finetune"


def stage_ends(lc, max_steps: int) -> dict[int, str]:
    """{step count at which a stage ends: that stage} for the stages that run and are followed by another."""
    ends = {}
    if lc.transfer_steps:
        ends[lc.transfer_steps] = "transfer"
    if lc.distill_steps:
        ends[lc.transfer_steps + lc.distill_steps] = "distill"
    return {step: stage for step, stage in ends.items() if step < max_steps}


def uses_teacher(lc) -> bool:
    return lc.transfer_steps + lc.distill_steps > 0
