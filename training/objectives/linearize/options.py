"""linearize.* of a train.py config (configs/train.yaml): each key's Rule (common/validation.py) and the checks
between keys, which train.py runs whatever the objective (the Linearize objective declares them)."""
from common.validation import Problems, Rule, count
from training.objectives.linearize.teacher import parse_keep_softmax

TRANSFER_TARGETS = ("mixer_core", "output")  # the input of the mixer's output projection | the mixer's output
RULES = {
    "linearize.transfer_steps": count(),
    "linearize.transfer_loss": Rule(str, choices=("mse", "relative")),
    "linearize.transfer_target": Rule(str, choices=TRANSFER_TARGETS),
    "linearize.transfer_trains": Rule(str, choices=("new", "mixer")),
    "linearize.select_steps": count(),
    "linearize.distill_steps": count(),
    "linearize.temperature": Rule(float, above=0),
    "linearize.ce_weight": Rule(float, at_least=0),
}
STAGE_KEYS = ("linearize.transfer_steps", "linearize.distill_steps")


def cross_checks(config: dict, problems: Problems) -> None:
    """The stages within trainer.max_steps, keep_softmax against the student's layers, and a teacher stage's
    init_from and objective."""
    lc = config.get("linearize")  # absent from the saved config of a run started before it existed
    if lc is None:
        return
    if config["trainer"]["max_steps"] is not None and problems.fine("trainer.max_steps", *STAGE_KEYS):
        problems.lines += steps_problems(config)  # with a budget, training/budget.py check_steps once it has set them
    if lc.get("keep_softmax") is not None and problems.fine("model.num_hidden_layers"):
        kinds = config["model"].get("mixer") or config["mixer"]["name"]
        try:
            parse_keep_softmax(lc["keep_softmax"],
                               kinds if isinstance(kinds, list) else [kinds] * config["model"]["num_hidden_layers"])
        except ValueError as e:
            problems.add(str(e))
    if not problems.fine(*STAGE_KEYS):
        return
    transfer, distill = lc["transfer_steps"], lc["distill_steps"]
    if transfer + distill and not config["init_from"]:
        problems.add(f"linearize.transfer_steps={transfer}, linearize.distill_steps={distill} "
                     f"with init_from=null; valid: init_from=<the softmax teacher: run dir or HF dir>")
    if transfer + distill and config["objective"] != "linearize":
        problems.add(f"linearize.transfer_steps={transfer}, linearize.distill_steps={distill} "
                     f"with objective={config['objective']}; valid: objective=linearize (experiment=linearize sets it)")


def steps_problems(config: dict) -> list[str]:
    """The stages are the run's first steps: they fit in trainer.max_steps."""
    lc, max_steps = config.get("linearize"), config["trainer"]["max_steps"]
    if lc is None or lc["transfer_steps"] + lc["distill_steps"] <= max_steps:
        return []
    return [f"linearize.transfer_steps={lc['transfer_steps']} + linearize.distill_steps={lc['distill_steps']}; "
            f"valid: <= trainer.max_steps={max_steps} (the stages are the run's first steps)"]
