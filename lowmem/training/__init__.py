"""The optimisation a run performs, one accumulation window at a time.

- ``run_context``: ``RunContext``, the parts of a run the step, evaluation and the loop pass around (the resolved
  options, accelerator, engine, precision, padding multiple, memory guard).
- ``accumulation``: one window's backward, the same gradient whatever engine runs it, and the ``Window`` the loop
  steps on (accelerate's own accumulation counters are set in one place there: ``start_window``).
- ``optim``: Adafactor, AdamWScale (nanoT5's RMS-scaled AdamW) and the warmup + decay schedules.
- ``state``: ``TrainState``, the counters every checkpoint keeps (step, epoch, tokens, the best model so far).
- ``stopping``: clean stops on SIGTERM / SIGINT, and the count of skipped non-finite steps.
- ``encoder_cache``: a frozen encoder's outputs computed once per example and read back.
- ``evaluation``: eval loss, generation and the best-model comparison.
- ``criteria``: what a micro-batch's backward differentiates: the token loss, or a preference objective's pair loss
  (``TokenLoss``, ``PreferenceLoss``), and the log's values of their sums.
- ``reference``: DPO's reference policy (``--reference``: copy, adapter, cached), one class each;
  ``reference_cache``: the cached reference's streamed, resumable pre-pass and its files.
- ``preference_eval``: evaluation on held-out preference pairs (reward accuracy, margins, NLLs).
- ``eval_cost``: what an evaluation costs, and the evaluation defaults that keep it within --eval_budget_s.
"""
