"""The values a checkpoint's state files must hold for a resume to use them: types and ranges of
``trainer_state.json`` (``lowmem.training.state.TrainState``), ``run_config.json``, ``process_N.pt`` (what
``Checkpointer.position`` writes) and ``scheduler.pt``. Each check returns what is wrong, in words, or None;
``checkpoint.validate`` counts a checkpoint whose state is wrong as damaged, so a resume skips it.

Pure functions over loaded values: nothing here reads a file or imports torch.
"""

from __future__ import annotations

import math

# TrainState's counters: whole numbers >= 0 ("tokens": the name of target_tokens before 2026-11-28)
COUNTERS = ("step", "epoch", "examples", "target_tokens", "tokens", "nonfinite_steps", "nonfinite_in_a_row")
OPTIONAL_NUMBERS = ("best_metric", "best_eval_loss")  # finite, or null before the first evaluation
OPTIONAL_RECORDS = ("loss_scaler", "last_eval", "eval_plan")  # objects, or null
PROCESS_KEYS = {"rng": dict, "data": dict, "log_offsets": dict, "interval": dict}  # what Checkpointer.load reads


def is_count(value) -> bool:
    """A whole number >= 0 (a JSON ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trainer_state_problem(state, step: int) -> str | None:
    """What is wrong with ``trainer_state.json``'s ``state`` in the checkpoint of ``step``, or None."""
    if not isinstance(state, dict):
        return f"trainer_state.json holds {type(state).__name__}, not an object"
    if "step" not in state:
        return "trainer_state.json has no step"
    for key in COUNTERS:
        if key in state and not is_count(state[key]):
            return f"trainer_state.json: {key} is {state[key]!r}, not a whole number >= 0"
    if state["step"] != step:
        return f"trainer_state.json: step is {state['step']}, in the folder of step {step}"
    for key in OPTIONAL_NUMBERS:
        if state.get(key) is not None and not is_finite(state[key]):
            return f"trainer_state.json: {key} is {state[key]!r}, not a finite number"
    best = state.get("best_step")
    if best is not None and not (is_count(best) and best <= step):
        return f"trainer_state.json: best_step is {best!r}, not a step from 0 to {step}"
    elapsed = state.get("elapsed_s", 0.0)
    if not (is_finite(elapsed) and elapsed >= 0):
        return f"trainer_state.json: elapsed_s is {elapsed!r}, not a number of seconds >= 0"
    for key in OPTIONAL_RECORDS:
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"trainer_state.json: {key} is {state[key]!r}, not an object"
    return None


def run_config_problem(config) -> str | None:
    """What is wrong with ``run_config.json``'s value, or None: the settings the run began with, an object."""
    if not isinstance(config, dict):
        return f"run_config.json holds {type(config).__name__}, not an object of settings"
    return None


def process_state_problem(state, name: str) -> str | None:
    """What is wrong with ``process_N.pt``'s value (``name``), or None: the RNG states, data position, log offsets
    and interval sums ``Checkpointer.load`` restores, each of its type."""
    if not isinstance(state, dict):
        return f"{name} holds {type(state).__name__}, not the dict of a process's state"
    for key, kind in PROCESS_KEYS.items():
        if not isinstance(state.get(key), kind):
            return f"{name}: {key} is {type(state.get(key)).__name__}, not a {kind.__name__}"
    rng = state["rng"]
    if not all(key in rng for key in ("python", "numpy", "torch")):
        return f"{name}: rng lacks {', '.join(k for k in ('python', 'numpy', 'torch') if k not in rng)}"
    if type(rng["torch"]).__name__ != "Tensor":
        return f"{name}: rng's torch state is {type(rng['torch']).__name__}, not a tensor"
    odd = [k for k, v in state["log_offsets"].items() if not is_count(v)]
    if odd:
        return f"{name}: log offset {odd[0]} is {state['log_offsets'][odd[0]]!r}, not a byte count"
    record = state.get("checkpoint_record")
    if record is not None and not isinstance(record, str):
        return f"{name}: checkpoint_record is {type(record).__name__}, not a line of text"
    return None


def scheduler_state_problem(state) -> str | None:
    """What is wrong with ``scheduler.pt``'s value, or None: a scheduler's state dict."""
    if not isinstance(state, dict):
        return f"scheduler.pt holds {type(state).__name__}, not a scheduler's state dict"
    return None
