"""Numerical claims: accumulation equivalence, token normalisation, SFT freezing, the lr schedule."""

from __future__ import annotations

import pytest
import torch
from conftest import synthetic_rows, write_rows

from data.sources.eval_set import take_examples
from lowmem.cli.flags import load_config
from lowmem.model.build import build_model
from lowmem.model.loss import target_index, token_loss_sum
from trainer_low_mem import LowMemTrainer

COLS = ("prompt", "response")


def make_trainer(tmp_path, tokenizer, model=None, **flags):
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(256, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(16, seed=2))
    base = dict(train_file=str(train), eval_file=str(evals), output_dir=str(tmp_path / "run"), dropout_rate=0.0,
                max_steps=4, eval_steps=0, save_steps=0, logging_steps=1, max_eval_samples=8, max_target_len=16)
    cfg, _ = load_config({**base, **flags})
    return LowMemTrainer(cfg, tokenizer=tokenizer, model=model).setup()


def grads(trainer):
    return torch.cat([p.grad.flatten().clone() for p in trainer.trainable_params])


def test_micro_2_x_accumulation_16_equals_one_batch_of_32(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer)
    examples = take_examples(trainer.files.train, COLS, 32)
    trainer.accumulate_gradients([trainer.data.collator(examples[i:i + 2]) for i in range(0, 32, 2)])
    accumulated = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate_gradients(trainer.data.collator.window(examples, 2))  # the training path: grouped by length
    grouped = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate_gradients([trainer.data.collator(examples)])
    one_batch = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    # Reference without our code path: transformers' own mean-over-target-tokens loss on 32 rows.
    batch = trainer.data.collator(examples)
    trainer.core(**batch).loss.backward()
    reference = grads(trainer)
    for got in (accumulated, grouped, one_batch):
        assert ((got - reference).norm() / reference.norm()).item() <= 1e-5
    assert accumulated.abs().sum() > 0


def test_window_pairs_rows_of_similar_length(tokenizer):
    from data.collate import Seq2SeqCollator
    from data.sources.corpus import Example

    collate = Seq2SeqCollator(tokenizer, max_source_len=64, max_target_len=64)
    examples = [Example("word " * n, "reply " * (n % 7 + 1), 0, n) for n in (1, 40, 2, 30, 3, 50, 4, 20)]
    grouped, plain = collate.window(examples, 2), collate.window(examples, 2, group=False)
    cells = [sum(mb["input_ids"].numel() + mb["labels"].numel() for mb in w) for w in (grouped, plain)]
    assert cells[0] < 0.8 * cells[1]  # less padding (314 against 416 cells)
    real = [sum(int(mb["attention_mask"].sum()) + int(mb["labels"].ne(-100).sum()) for mb in w)
            for w in (grouped, plain)]
    assert real[0] == real[1]  # the same tokens, only paired differently


def test_short_windows_are_token_normalised(tmp_path, tokenizer):
    """A window of unequal micro-batches weights every target token equally (no mean of means)."""
    trainer = make_trainer(tmp_path, tokenizer)
    examples = take_examples(trainer.files.train, COLS, 5)
    trainer.accumulate_gradients([trainer.data.collator(examples[:1]), trainer.data.collator(examples[1:])])
    split = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate_gradients([trainer.data.collator(examples)])
    whole = grads(trainer)
    assert ((split - whole).norm() / whole.norm()).item() <= 1e-5


@pytest.mark.parametrize("loss_chunk", [0, "auto"])  # the whole logits at the targets, or a chunk at a time
def test_token_loss_sum_matches_transformers_loss(tmp_path, tokenizer, loss_chunk):
    cfg, _ = load_config({"dropout_rate": 0.0})
    model = build_model(cfg, tokenizer).eval()
    rows = synthetic_rows(6)
    from data.collate import Seq2SeqCollator
    from data.sources.corpus import Example

    batch = Seq2SeqCollator(tokenizer, 32, 32)([Example(r["prompt"], r["response"], 0, i) for i, r in enumerate(rows)])
    assert (batch["labels"] == -100).any()  # padded targets: the logits skip them
    ours = token_loss_sum(model, model, batch, loss_chunk=loss_chunk)
    (ours / (batch["labels"] != -100).sum()).backward()
    selected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    theirs = model(**batch).loss
    theirs.backward()
    assert torch.allclose(ours / (batch["labels"] != -100).sum(), theirs, rtol=1e-6)
    full = [p.grad for p in model.parameters()]
    for mine, ref in zip(selected, full):
        if loss_chunk == 0:  # the same operations, fewer rows
            assert torch.allclose(mine, ref, rtol=1e-5, atol=1e-8)
        else:  # the same sums in another order
            assert (mine - ref).norm() <= 1e-5 * ref.norm() + 1e-12
    # the positions found on the host (as the trainer passes them) give the same loss
    with_index = token_loss_sum(model, model, {**batch, "target_index": target_index(batch["labels"])},
                                loss_chunk=loss_chunk)
    assert torch.equal(with_index.detach(), ours.detach())


def test_padding_to_multiples_changes_no_loss_and_no_encoder_state(tokenizer):
    """bf16 on the CPU pads lengths and target counts to multiples of 16 (trainer.shape_multiple):
    the shapes change, the loss and the frozen encoder's outputs must not."""
    from data.collate import Seq2SeqCollator
    from data.sources.corpus import Example
    from lowmem.model.loss import frozen_encoder_states

    cfg, _ = load_config({"dropout_rate": 0.0})
    model = build_model(cfg, tokenizer).eval()
    examples = [Example(r["prompt"], r["response"], 0, i) for i, r in enumerate(synthetic_rows(5, seed=3))]
    plain = Seq2SeqCollator(tokenizer, 40, 40)(examples)
    padded = Seq2SeqCollator(tokenizer, 40, 40, pad_multiple=16)(examples)
    assert padded["input_ids"].shape[1] % 16 == 0 and padded["labels"].shape[1] % 16 == 0
    assert padded["input_ids"].shape[1] > plain["input_ids"].shape[1]
    index = target_index(padded["labels"], 16)
    assert len(index) % 16 == 0 and len(index) > int((padded["labels"] != -100).sum())
    assert torch.equal(index[:len(target_index(padded["labels"]))], target_index(padded["labels"]))
    with torch.no_grad():
        loss = token_loss_sum(model, model, plain)
        loss_padded = token_loss_sum(model, model, padded, frozen_encoder=True, multiple=16)
        assert torch.allclose(loss_padded, token_loss_sum(model, model, plain, frozen_encoder=True), rtol=1e-6)
        assert torch.allclose(loss_padded, loss, rtol=1e-6)
        states = frozen_encoder_states(model.encoder, plain["input_ids"], plain["attention_mask"])
        states_padded = frozen_encoder_states(model.encoder, padded["input_ids"], padded["attention_mask"], 16)
    width = states.shape[1]
    # to rounding: a few units in the last place of states up to about 4 (2.4e-7 each); padding changes the
    # shapes of the matrix products, and so their order of additions
    assert torch.allclose(states_padded[:, :width], states, atol=4e-6) and not states_padded[:, width:].any()


@pytest.mark.parametrize("tied", [False, True], ids=["own_head", "tied_head"])
def test_sft_trains_the_decoder_and_a_head_of_its_own(tmp_path, tokenizer, tied):
    """SFT's --freeze=encoder keeps the encoder and the shared embedding bit-identical. The decoder trains, and
    so does the output layer when it is a matrix of its own (the presets' default, as in T5 v1.1 and flan-t5):
    a head tied to the frozen embedding could not learn to write the tokens pretraining never wrote."""
    cfg, _ = load_config({"dropout_rate": 0.0, "tie_word_embeddings": tied})
    pretrained = build_model(cfg, tokenizer)
    assert (pretrained.lm_head.weight is pretrained.shared.weight) is tied
    pretrained.save_pretrained(tmp_path / "pre")
    before = {k: v.clone() for k, v in pretrained.state_dict().items()}
    trainer = make_trainer(tmp_path, tokenizer, is_finetune=True, init_from=str(tmp_path / "pre"), max_steps=3,
                           learn_rate=1e-2)
    assert (trainer.core.lm_head.weight is trainer.core.shared.weight) is tied  # loaded as built
    trainer._set_train_mode()
    assert trainer.core.encoder.training is False and trainer.core.decoder.training is True
    trainer.train()
    after = trainer.core.state_dict()
    head = ("lm_head.",)
    frozen = [k for k in before if k.startswith(("encoder.", "shared.", *(head if tied else ())))]
    trained = [k for k in before if k.startswith(("decoder.", *(() if tied else head))) and "embed_tokens" not in k]
    assert frozen and trained and ("lm_head.weight" in trained) is not tied
    for key in frozen:
        assert torch.equal(before[key], after[key]), key
    changed = [k for k in trained if not torch.equal(before[k], after[k])]
    assert len(changed) == len(trained)
    # Optimizer state exists for the trained tensors only.
    trained_params = {id(p) for n, p in trainer.core.named_parameters() if p.requires_grad}
    names = [n for n, p in trainer.core.named_parameters() if p.requires_grad]
    assert all(n.startswith("decoder.") or n == "lm_head.weight" and not tied for n in names)
    assert set(map(id, trainer.optimizer.state.keys())) <= trained_params
    assert len(trainer.optimizer.state) == len(trained_params)
    trainer.close()


def test_learning_rate_is_applied_with_warmup_and_decay(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, learn_rate=0.01, warmup_steps=2, max_steps=6)
    seen = []
    for _ in range(6):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()  # no gradients: nothing changes, but the order is the real one
        trainer.scheduler.step()
    # Warmup over 2 steps (the first one already trains) up to the peak on step 3, applied once, then
    # linear decay to 0 after step 6.
    assert seen == pytest.approx([0.01 / 3, 0.02 / 3, 0.01, 0.0075, 0.005, 0.0025])
    opt = trainer.optimizer.optimizer
    assert opt.defaults["relative_step"] is False and opt.defaults["scale_parameter"] is False
    trainer.close()


def test_warmup_longer_than_the_run_is_kept_and_said(tmp_path, tokenizer, capsys):
    trainer = make_trainer(tmp_path, tokenizer, learn_rate=0.01, warmup_steps=9, max_steps=4)
    assert "--warmup_steps=9 is not below the run's 4 steps: the run ends in the warmup, at 4/10 of --learn_rate" \
        in capsys.readouterr().out
    seen = []
    for _ in range(4):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.scheduler.step()
    # The rates of a longer run's first 4 steps: each warmup step's rate does not depend on the run's length
    assert seen == pytest.approx([0.001, 0.002, 0.003, 0.004])
    trainer.close()


@pytest.mark.parametrize("beta1, weight_decay", [(None, 0.0), (0.9, 0.01)])
def test_our_adafactor_is_transformers_adafactor_bit_for_bit(beta1, weight_decay):
    from transformers.optimization import Adafactor as Reference

    from lowmem.training.optim import Adafactor

    torch.manual_seed(0)
    shapes = [(16, 8), (8,), (3, 4, 5)]
    ours, theirs = ([torch.nn.Parameter(torch.randn(s)) for s in shapes] for _ in range(2))
    for a, b in zip(ours, theirs):
        b.data.copy_(a.data)
    opt_a = Adafactor(ours, lr=3e-3, beta1=beta1, weight_decay=weight_decay)
    opt_b = Reference(theirs, lr=3e-3, beta1=beta1, weight_decay=weight_decay, relative_step=False,
                      scale_parameter=False, warmup_init=False)
    for _ in range(6):
        grads = [torch.randn(s) for s in shapes]
        for params, opt in ((ours, opt_a), (theirs, opt_b)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not torch.equal(ours[0], theirs[0] * 0)  # they moved


@pytest.mark.parametrize("name", ["linear", "cosine", "constant"])
def test_schedules_match_transformers_after_a_warmup_whose_first_step_trains(name):
    from transformers import get_scheduler

    from lowmem.training.optim import warmup_schedule

    rates = []
    for make in (lambda o: warmup_schedule(o, name, 7, 40),
                 lambda o: get_scheduler("constant_with_warmup" if name == "constant" else name, o,
                                         num_warmup_steps=7, num_training_steps=40)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        sched, seen = make(opt), []
        for _ in range(45):
            seen.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        rates.append(seen)
    assert rates[0][7:40] == rates[1][7:40]  # after warmup: transformers' rates exactly
    # past the 40 planned steps (an epoch of packed text longer than estimated): the last planned rate, where
    # transformers' linear decay gives 0 and its cosine a second cycle
    assert rates[0][40:] == [rates[0][39]] * 5
    # Warmup: step k (from 1) applies k/8 of the rate; transformers' (k-1)/7 leaves step 1 at 0. Both
    # reach the peak at step 8, once.
    assert rates[0][:7] == pytest.approx([2e-3 * k / 8 for k in range(1, 8)])
    assert rates[0].count(2e-3) == rates[1].count(2e-3) == (45 - 7 if name == "constant" else 1)
    assert rates[1][:7] == pytest.approx([2e-3 * (k - 1) / 7 for k in range(1, 8)])


def test_a_resume_applies_this_commands_rate_and_schedule_from_its_first_step():
    from lowmem.training.optim import Adafactor, resume_schedule, warmup_schedule

    def run(lr, total, steps, state=None):
        param = torch.nn.Parameter(torch.ones(3))
        opt = Adafactor([param], lr=lr, weight_decay=0.01)
        sched = warmup_schedule(opt, "linear", 4, total)
        if state is not None:
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
            resume_schedule(opt, sched, lr, 0.01)
        rates = []
        for _ in range(steps):
            rates.append(sched.get_last_lr()[0])
            assert opt.param_groups[0]["lr"] == rates[-1]
            param.grad = torch.ones(3)
            opt.step()
            sched.step()
        return rates, (opt.state_dict(), sched.state_dict())

    straight, _ = run(3e-3, 16, 16)
    first, saved = run(3e-3, 16, 10)
    again, _ = run(3e-3, 16, 6, saved)
    assert first + again == straight  # unchanged settings: the very same rates
    longer, _ = run(3e-3, 20, 10, saved)  # --max_steps raised from 16 to 20
    assert longer == pytest.approx([3e-3 * (20 - k) / 16 for k in range(10, 20)])  # not the old schedule's first
    lower, _ = run(1e-3, 16, 6, saved)  # --learn_rate lowered
    assert lower == pytest.approx([r / 3 for r in straight[10:]])


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "adamw_scale"])
def test_weight_decay_leaves_layer_norms_and_position_biases_alone(tokenizer, optimizer):
    from lowmem.training.optim import build_optimizer, parameter_groups, resume_schedule, warmup_schedule

    cfg, _ = load_config({"optimizer": optimizer, "weight_decay": 0.5, "learn_rate": 0.1, "warmup_steps": 0})
    model = build_model(cfg, tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(cfg, parameter_groups(model, cfg.weight_decay))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: what changes is the decay alone
    optimizer.step()
    exempt = [name for name, p in model.named_parameters() if p.dim() == 1 or "relative_attention_bias" in name]
    assert any("layer_norm" in name for name in exempt) and any("relative_attention_bias" in name for name in exempt)
    for name, p in model.named_parameters():
        if name in exempt:
            assert torch.equal(p, before[name]), name
        else:
            torch.testing.assert_close(p, before[name] * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)
    scheduler = warmup_schedule(optimizer, "constant", 0, 10)
    resume_schedule(optimizer, scheduler, 0.1, 0.2)  # a resume with another --weight_decay
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    # without weight decay: one group, the layout of checkpoints written before the exemption
    assert len(parameter_groups(model, 0.0)) == 1


def test_a_resume_keeps_the_optimizer_state_in_its_parameter_groups(tmp_path):
    from lowmem.runs.run_folder import compare_settings
    from lowmem.utils.errors import UserError

    decayed = {"weight_decay": 0.01, "parameter_group_sizes": [40, 25]}
    compare_settings(decayed, {**decayed, "weight_decay": 0.1}, tmp_path)  # another non-zero value: same groups
    with pytest.raises(UserError, match="resume with a non-zero --weight_decay"):
        compare_settings(decayed, {"weight_decay": 0.0, "parameter_group_sizes": [65]}, tmp_path)
    with pytest.raises(UserError, match="resume with a zero --weight_decay"):
        compare_settings({"weight_decay": 0.0, "parameter_group_sizes": [65]}, decayed, tmp_path)
    # written before the exemption: one group, which a run without weight decay still finds
    compare_settings({"weight_decay": 0.01}, {"weight_decay": 0.0, "parameter_group_sizes": [65]}, tmp_path)
    with pytest.raises(UserError, match="earlier version"):
        compare_settings({"weight_decay": 0.01}, decayed, tmp_path)


def test_a_signal_stops_an_evaluation_at_its_next_batch_and_checkpoints(tmp_path, tokenizer):
    """A generation of 100 eval rows outlasted a scheduler's grace period (Slurm's is 30 s): the signal
    waited for it. Now the evaluation stops before its next batch, nothing of it is used, and the run
    checkpoints and exits with the signal's code (a resume runs the evaluation again)."""
    from tqdm import tqdm

    from lowmem.training.stopping import StoppedBySignal

    trainer = make_trainer(tmp_path, tokenizer, eval_generate=True)
    trainer.bar = tqdm(disable=True)
    trainer.signals.received = "SIGTERM"
    with pytest.raises(StoppedBySignal) as stop:
        trainer.evaluate_and_keep_best()
    assert stop.value.exit_code == 143 and trainer.state.last_eval is None
    assert (tmp_path / "run" / "checkpoints" / "step_000000").is_dir() and not (tmp_path / "run" / "best").exists()


def test_the_fused_gelu_computes_the_models_own_activation(tokenizer):
    """ready_to_train runs gated-gelu's gelu_new as torch's fused tanh-GELU: the same function to rounding, so
    the model the trainer trains is the one its config (and export) names; ReLU models are left alone."""
    import copy

    from lowmem.model.build import fuse_gelu
    from lowmem.utils.presets import MODEL_PRESETS

    cfg, _ = load_config({"dropout_rate": 0.0, "model_preset": "tiny"})
    model = build_model(cfg, tokenizer).eval()
    fused = copy.deepcopy(model)
    shape = MODEL_PRESETS[cfg.model_preset]
    assert fuse_gelu(fused) == shape["num_layers"] + shape["num_decoder_layers"]  # one per block
    assert fuse_gelu(fused) == 0
    assert fused.config.feed_forward_proj == "gated-gelu"
    ids = torch.randint(2, len(tokenizer), (3, 20))
    with torch.no_grad():
        plain, fast = (m(input_ids=ids, decoder_input_ids=ids).logits for m in (model, fused))
    assert (plain - fast).abs().max().item() <= 1e-5  # rounding, not another function
    relu = build_model(load_config({"feed_forward_proj": "relu"})[0], tokenizer)
    assert fuse_gelu(relu) == 0

