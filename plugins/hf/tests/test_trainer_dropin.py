"""``corelooper_hf.Trainer`` against the real ``transformers.Trainer`` on the same inputs: the oracle.

The same script runs under both classes (the same model, deep-copied; the same data, seed and
``TrainingArguments``; dropout on; random order): the event sequence a ``TrainerCallback`` sees,
``state.log_history`` (loss, grad_norm, learning_rate, epoch, eval entries, to 1e-4 relative,
per step), ``global_step``, the eval loss and the final weights must be HF's. HF's own callback
tests (transformers' tests/trainer/test_trainer_callback.py: event flow, add/pop/remove, stateful
callbacks, stop flags) are re-expressed against both classes.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from corelooper_hf import Trainer  # noqa: E402
from transformers import (  # noqa: E402
    EarlyStoppingCallback,
    TrainerCallback,
    TrainingArguments,
)
from transformers import Trainer as HFTrainer  # noqa: E402
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback  # noqa: E402

from corelooper.errors import ConfigError  # noqa: E402

# Every test here trains under both classes (about 5 s or more on 2 cores): the slow lane.
pytestmark = pytest.mark.slow

VOCAB, SEQ = 48, 12
EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_epoch_end",
    "on_log",
    "on_evaluate",
    "on_prediction_step",
    "on_save",
    "on_train_end",
)


def tiny_llama(seed: int = 0, dropout: float = 0.1):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attention_dropout=dropout,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lm_rows(n: int, seed: int = 0, difficulty: bool = False) -> list[dict]:
    """Right-padded sequences of varied length; padding has label -100."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        row = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if difficulty:
            row["difficulty"] = torch.rand((), generator=g) * 2
        rows.append(row)
    return rows


class Recorder(TrainerCallback):
    """HF's test_event_flow recorder: every event with the step it fired at."""

    def __init__(self, stop_at: int | None = None):
        self.events: list[tuple[str, int]] = []
        self.stop_at = stop_at


def _record(name):
    def method(self, args, state, control, **kwargs):
        self.events.append((name, state.global_step))
        if name == "on_step_end" and self.stop_at == state.global_step:
            control.should_training_stop = True

    return method


for _name in EVENTS:
    setattr(Recorder, _name, _record(_name))


def args_for(out, **kw) -> TrainingArguments:
    base = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        max_grad_norm=0.5,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return TrainingArguments(output_dir=str(out), **{**base, **kw})


def run_both(tmp_path, trainer_kw=None, callbacks=(), subclass=None, model=None, **kw):
    """The same script under transformers.Trainer and corelooper_hf.Trainer: both trainers,
    their recorders and TrainOutputs."""
    model = model if model is not None else tiny_llama(seed=1)
    out = {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        cls = subclass(cls) if subclass is not None else cls
        recorder = Recorder(kw.pop("stop_at", None) if name == "cl" else kw.get("stop_at"))
        args_kw = {k: v for k, v in kw.items() if k != "stop_at"}
        trainer = cls(
            model=copy.deepcopy(model),
            args=args_for(tmp_path / name, **args_kw),
            callbacks=[recorder, *[copy.deepcopy(c) for c in callbacks]],
            **(trainer_kw or {}),
        )
        result = trainer.train()
        out[name] = (trainer, recorder, result)
    return out


def assert_same_history(hf_history: list[dict], cl_history: list[dict], rel: float = 1e-4) -> None:
    hf_steps = [h for h in hf_history if "train_runtime" not in h]
    cl_steps = [h for h in cl_history if "train_runtime" not in h]
    assert [h["step"] for h in cl_steps] == [h["step"] for h in hf_steps]
    for h, c in zip(hf_steps, cl_steps, strict=True):
        keys = {k for k in h if k in ("loss", "grad_norm", "learning_rate", "epoch") or k.startswith("eval_")}
        keys = {k for k in keys if not k.endswith(("_runtime", "_per_second", "_preparation_time"))}
        assert keys <= set(c), (h, c)
        for k in keys:
            assert c[k] == pytest.approx(h[k], rel=rel, abs=1e-7), (k, h, c)


def assert_same_weights(hf_model, cl_model, atol: float = 1e-5) -> None:
    cl = dict(cl_model.named_parameters())
    for name, p in hf_model.named_parameters():
        torch.testing.assert_close(cl[name].detach(), p.detach(), atol=atol, rtol=1e-4, msg=name)


# -- the numbers and the events ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(gradient_accumulation_steps=1, eval_strategy="steps", eval_steps=3),
        dict(gradient_accumulation_steps=4, per_device_train_batch_size=2, eval_strategy="epoch"),
        dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2, logging_first_step=True),
    ],
    ids=["ga1-eval-steps", "ga4-eval-epoch", "ga2-logging-first-step"],
)
def test_same_events_log_history_and_weights_as_hf(tmp_path, kw):
    train, evaluation = lm_rows(28, seed=3), lm_rows(10, seed=4)
    runs = run_both(tmp_path, trainer_kw=dict(train_dataset=train, eval_dataset=evaluation), **kw)
    (hf, hf_rec, hf_out), (cl, cl_rec, cl_out) = runs["hf"], runs["cl"]
    assert cl_rec.events == hf_rec.events
    assert cl.state.global_step == hf.state.global_step
    assert_same_history(hf.state.log_history, cl.state.log_history)
    assert cl_out.training_loss == pytest.approx(hf_out.training_loss, rel=1e-4)
    assert set(cl_out.metrics) == set(hf_out.metrics)
    assert_same_weights(hf.model, cl.model)
    assert any("eval_loss" in h for h in cl.state.log_history)


def test_a_callback_stopping_training_stops_both_at_the_same_step(tmp_path):
    train, evaluation = lm_rows(24, seed=3), lm_rows(8, seed=4)
    runs = run_both(
        tmp_path,
        trainer_kw=dict(train_dataset=train, eval_dataset=evaluation),
        stop_at=3,
        eval_strategy="epoch",
    )
    (hf, hf_rec, _), (cl, cl_rec, _) = runs["hf"], runs["cl"]
    assert hf.state.global_step == cl.state.global_step == 3
    assert cl_rec.events == hf_rec.events
    assert_same_history(hf.state.log_history, cl.state.log_history)


class StepEndOnly(TrainerCallback):
    """Implements one step event: the bridge tells the others to no callback (its fast path)."""

    def __init__(self):
        self.seen: list[tuple] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(
            (state.global_step, control.should_log, control.should_evaluate, control.should_save)
        )
        if state.global_step == 3:  # a flag set here is obeyed
            control.should_save = True


def flags_spying(base, seen: list):
    class FlagsSpy(base):
        """What user code reads of ``self.state`` and ``self.control`` in every forward."""

        def compute_loss(self, model, inputs, **kwargs):
            control = self.control
            seen.append(
                (self.state.global_step, control.should_log, control.should_evaluate, control.should_save)
            )
            return super().compute_loss(model, inputs, **kwargs)

    return FlagsSpy


@pytest.mark.parametrize("callbacks", ["defaults", "one-step-event"])
def test_step_events_no_callback_implements_leave_state_and_flags_as_hf(tmp_path, callbacks):
    """With only HF's default callbacks (and one that implements ``on_step_end`` alone) the bridge
    tells no callback of the other step events, as no callback would act on them: the state and
    flags user code reads in the step and in evaluation, the callback's view, the logs and the
    saves stay HF's."""
    train, evaluation = lm_rows(20, seed=3), lm_rows(8, seed=4)
    seen, spies, history, folders = {}, {}, {}, {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        seen[name], spy = [], StepEndOnly()
        trainer = flags_spying(cls, seen[name])(
            model=tiny_llama(seed=1),
            args=args_for(
                tmp_path / name,
                gradient_accumulation_steps=2,
                per_device_train_batch_size=2,
                logging_first_step=True,
                eval_strategy="steps",
                eval_steps=2,
                save_strategy="steps",
                save_steps=4,
            ),
            train_dataset=train,
            eval_dataset=evaluation,
            callbacks=[] if callbacks == "defaults" else [spy],
        )
        if name == "cl":
            assert not trainer.bridge.heard("on_substep_end") and not trainer.bridge.heard("on_step_begin")
            assert trainer.bridge.heard("on_step_end")  # HF's DefaultFlowCallback
            assert any(type(cb) is DefaultFlowCallback for cb in trainer.callback_handler.callbacks)
        trainer.train()
        spies[name], history[name] = spy.seen, trainer.state.log_history
        folders[name] = sorted(p.name for p in (tmp_path / name).glob("checkpoint-*"))
    assert len(seen["cl"]) == 20 + 5 * 2 and seen["cl"] == seen["hf"]  # 20 micro-batches, 5 evaluations
    assert spies["cl"] == spies["hf"]
    assert_same_history(history["hf"], history["cl"])
    saved = ["checkpoint-10", "checkpoint-4", "checkpoint-8"]  # the last step's too, as HF 5
    if callbacks != "defaults":
        saved.insert(1, "checkpoint-3")
    assert folders["cl"] == folders["hf"] == saved


# -- a subclass: the typical job's per-sample weighted loss ------------------------------------------


def weighted_loss(base):
    class WeightedLossTrainer(base):
        """Each sample's token losses weighted by its 'difficulty' column (HF docs' way to customise)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            difficulty = inputs.pop("difficulty")
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].float()
            targets = labels[:, 1:]
            per_token = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
            ).view(targets.shape)
            weighted = (per_token * difficulty[:, None]).sum()
            loss = weighted / (
                num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum()
            )
            return (loss, outputs) if return_outputs else loss

    return WeightedLossTrainer


@pytest.mark.parametrize("ga", [1, 2])
def test_a_weighted_loss_subclass_runs_unchanged_with_hfs_num_items_in_batch(tmp_path, ga):
    seen = {"hf": [], "cl": []}

    def recording(base):
        cls = weighted_loss(base)

        class Recording(cls):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                who = "cl" if isinstance(self, Trainer) else "hf"
                seen[who].append(None if num_items_in_batch is None else int(num_items_in_batch))
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        return Recording

    train = lm_rows(16, seed=5, difficulty=True)
    runs = run_both(
        tmp_path,
        trainer_kw=dict(train_dataset=train),
        subclass=recording,
        remove_unused_columns=False,
        gradient_accumulation_steps=ga,
        per_device_train_batch_size=4 // ga,
        logging_steps=1,
    )
    (hf, _, _), (cl, _, _) = runs["hf"], runs["cl"]
    assert seen["cl"] == seen["hf"] and all(n is not None for n in seen["cl"])
    assert_same_history(hf.state.log_history, cl.state.log_history)
    assert_same_weights(hf.model, cl.model)


# -- callbacks: HF's own tests, both classes --------------------------------------------------------


class MyTestTrainerCallback(TrainerCallback):
    pass


@pytest.mark.parametrize("cls", [HFTrainer, Trainer], ids=["hf", "cl"])
def test_add_pop_remove_callback_as_hfs_test(tmp_path, cls):
    """transformers' test_add_remove_callback, run against both classes."""
    args = args_for(tmp_path, disable_tqdm=False)
    trainer = cls(model=tiny_llama(), args=args, train_dataset=lm_rows(4))
    expected = [DefaultFlowCallback, ProgressCallback]
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == expected
    trainer.add_callback(MyTestTrainerCallback)
    expected.append(MyTestTrainerCallback)
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == expected
    popped = trainer.pop_callback(MyTestTrainerCallback)
    assert isinstance(popped, MyTestTrainerCallback)
    expected.pop()
    cb = DefaultFlowCallback()
    trainer.add_callback(cb)
    trainer.remove_callback(DefaultFlowCallback)
    assert [type(c) for c in trainer.callback_handler.callbacks] == [ProgressCallback, DefaultFlowCallback]
    trainer.remove_callback(cb)
    assert [type(c) for c in trainer.callback_handler.callbacks] == [ProgressCallback]
    quiet = cls(model=tiny_llama(), args=args_for(tmp_path / "q"), train_dataset=lm_rows(4))
    assert [type(c) for c in quiet.callback_handler.callbacks] == [DefaultFlowCallback, PrinterCallback]


def test_early_stopping_and_the_best_model_as_hf(tmp_path):
    train, evaluation = lm_rows(32, seed=3), lm_rows(8, seed=4)
    runs = run_both(
        tmp_path,
        trainer_kw=dict(train_dataset=train, eval_dataset=evaluation),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=0.5)],
        num_train_epochs=6,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    (hf, hf_rec, _), (cl, cl_rec, _) = runs["hf"], runs["cl"]
    assert cl.state.global_step == hf.state.global_step < hf.state.max_steps  # stopped early
    assert cl_rec.events == hf_rec.events
    assert cl.state.best_metric == pytest.approx(hf.state.best_metric, rel=1e-4)
    assert cl.state.best_global_step == hf.state.best_global_step
    assert (
        cl.state.best_model_checkpoint.rsplit("/", 1)[-1] == hf.state.best_model_checkpoint.rsplit("/", 1)[-1]
    )
    assert_same_weights(hf.model, cl.model)  # the best model, loaded at the end in both


@pytest.mark.parametrize("cls", [HFTrainer, Trainer], ids=["hf", "cl"])
@pytest.mark.parametrize("restore", [True, False])
def test_stateful_callbacks_are_saved_in_and_restored_from_corelooper_checkpoints(tmp_path, restore, cls):
    """EarlyStoppingCallback's patience counter survives a resume when HF's
    restore_callback_states_from_checkpoint asks for it, and only then (HF's rule): the same
    test against both classes (the drop-in keeps the states in corelooper's checkpoints)."""
    train, evaluation = lm_rows(24, seed=3), lm_rows(8, seed=4)
    kw = dict(
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="eval_loss",
        restore_callback_states_from_checkpoint=restore,
        num_train_epochs=1,  # 6 steps: evaluations at 2, 4, 6
    )

    def trainer(out, stopper, *extra):
        return cls(
            model=tiny_llama(),
            args=args_for(out, **kw),
            train_dataset=train,
            eval_dataset=evaluation,
            callbacks=[stopper, *extra],
        )

    def stopper():  # no evaluation improves by 10: the counter counts every one after the first
        return EarlyStoppingCallback(early_stopping_patience=100, early_stopping_threshold=10.0)

    whole = stopper()
    trainer(tmp_path / "whole", whole).train()
    assert whole.early_stopping_patience_counter == 2
    first = stopper()
    trainer(tmp_path / "cut", first, Recorder(stop_at=4)).train()
    assert first.early_stopping_patience_counter == 1
    again = stopper()
    resumed = trainer(tmp_path / "cut", again)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    # HF replaces a restored callback with a new instance: read the one in the handler
    (running,) = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback)]
    assert running.early_stopping_patience_counter == (2 if restore else 1)


def test_resume_mid_epoch_gives_the_uninterrupted_run(tmp_path):
    train, evaluation = lm_rows(28, seed=3), lm_rows(8, seed=4)
    kw = dict(save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3, logging_steps=1)
    whole = Trainer(
        model=tiny_llama(seed=2),
        args=args_for(tmp_path / "whole", **kw),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    whole.train()
    cut = Trainer(
        model=tiny_llama(seed=2),
        args=args_for(tmp_path / "cut", **kw),
        train_dataset=train,
        eval_dataset=evaluation,
        callbacks=[Recorder(stop_at=5)],
    )
    cut.train()  # stops after step 5; checkpoint-3 is mid-epoch (7 steps per epoch)
    resumed = Trainer(
        model=tiny_llama(seed=9),
        args=args_for(tmp_path / "cut", **kw),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert resumed.state.global_step == whole.state.global_step == 14
    assert_same_history(
        whole.state.log_history, resumed.state.log_history, rel=1e-6
    )  # HF's history came along
    assert_same_weights(whole.model, resumed.model, atol=1e-7)


# -- evaluation and prediction --------------------------------------------------------------------------


def token_accuracy(eval_pred):
    predictions, labels = eval_pred.predictions, eval_pred.label_ids
    assert type(predictions).__module__ == "numpy" and type(labels).__module__ == "numpy"
    hits = (predictions.argmax(-1)[:, :-1] == labels[:, 1:]) & (labels[:, 1:] != -100)
    return {"token_accuracy": float(hits.sum() / (labels[:, 1:] != -100).sum())}


def test_evaluate_and_predict_as_hf(tmp_path):
    train, evaluation = lm_rows(16, seed=3), lm_rows(10, seed=4)  # 10 rows: a short last batch
    model = tiny_llama(seed=1)
    results = {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        trainer = cls(
            model=copy.deepcopy(model),
            args=args_for(tmp_path / name, max_steps=3),
            train_dataset=train,
            eval_dataset=evaluation,
            compute_metrics=token_accuracy,
        )
        trainer.train()
        metrics = trainer.evaluate()
        prediction = trainer.predict(evaluation)
        named = trainer.evaluate({"a": evaluation, "b": lm_rows(4, seed=8)})
        results[name] = (metrics, prediction, named, trainer)
    (hm, hp, hn, hf), (cm, cp, cn, cl) = results["hf"], results["cl"]
    for key in ("eval_loss", "eval_token_accuracy", "epoch"):
        assert cm[key] == pytest.approx(hm[key], rel=1e-5), key
    assert set(cm) == set(hm)
    assert set(cn) == set(hn) and cn["eval_b_loss"] == pytest.approx(hn["eval_b_loss"], rel=1e-5)
    assert cp.predictions.shape == hp.predictions.shape and type(cp.predictions) is type(hp.predictions)
    assert abs(cp.predictions - hp.predictions).max() < 1e-5
    assert (cp.label_ids == hp.label_ids).all()
    assert cp.metrics["test_loss"] == pytest.approx(hp.metrics["test_loss"], rel=1e-5)
    assert_same_history(hf.state.log_history, cl.state.log_history)


# -- what the drop-in cannot honour --------------------------------------------------------------------


def test_an_override_the_drop_in_never_calls_is_refused_naming_the_corelooper_way(tmp_path):
    class Custom(Trainer):
        def _inner_training_loop(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(ConfigError) as err:
        Custom(model=tiny_llama(), args=args_for(tmp_path), train_dataset=lm_rows(4))
    message = str(err.value)
    assert "Custom._inner_training_loop" in message and "training_step" in message and "silently" in message


def test_training_arguments_corelooper_cannot_honour_are_refused_in_one_paragraph(tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(model=tiny_llama(), args=args_for(tmp_path, push_to_hub=True), train_dataset=lm_rows(4))
    message = str(err.value)
    assert "push_to_hub" in message and "hf upload" in message and "\n" not in message


# -- two processes -----------------------------------------------------------------------------------


def torchrun(which: str, out, tmp_path, sharding: str = "ddp") -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("dropin_worker.py")
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    proc = subprocess.run(
        [*cmd, which, str(out), sharding], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r: json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def hf_two_processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf2")
    return torchrun("hf", tmp / "hf", tmp)


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", ["ddp", "zero3", "fsdp2"])
def test_two_processes_weighted_loss_subclass_as_hf(tmp_path, hf_two_processes, sharding):
    """The typical job as code: the weighted-loss subclass on 2 gloo processes, GA 2, under DDP,
    DeepSpeed ZeRO-3 (HF's deepspeed= dict, "auto" values) and FSDP2 (HF's fsdp= and
    fsdp_config=): HF's numbers (HF's Trainer on DDP: ZeRO-3 and FSDP2 compute the same step),
    and the same weights on both ranks."""
    hf = hf_two_processes
    cl = torchrun("cl", tmp_path / "cl", tmp_path, sharding)
    assert cl[0]["step"] == hf[0]["step"] == 6
    assert_same_history(hf[0]["log_history"], cl[0]["log_history"])
    assert cl[0]["params"] == cl[1]["params"]  # the ranks agree
    for rank in (0, 1):  # as HF: the events (on_log too), the history and the TrainOutput on every rank
        assert cl[rank]["events"] == hf[rank]["events"], rank
        assert_same_history(hf[rank]["log_history"], cl[rank]["log_history"])
        assert cl[rank]["train_output"][:2] == pytest.approx(hf[rank]["train_output"][:2], rel=1e-4)
    for name, value in hf[0]["params"].items():
        assert cl[0]["params"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


MOVE_OVER = dict(eval_strategy="steps", eval_steps=2, logging_steps=1)


@pytest.fixture(scope="module")
def hf_uninterrupted(tmp_path_factory):
    """HF's uninterrupted run that every moved-over run must end as, trained once for both cut
    points: theirs differ only in save_steps, and a save draws no random number and moves no
    weight (this one saves nothing)."""
    whole = HFTrainer(
        model=tiny_llama(seed=2),
        args=args_for(tmp_path_factory.mktemp("whole"), save_strategy="no", **MOVE_OVER),
        train_dataset=lm_rows(28, seed=3),
        eval_dataset=lm_rows(8, seed=4),
    )
    whole.train()
    return whole


@pytest.mark.parametrize("stop_at", [3, 7], ids=["mid-epoch", "epoch-end"])
def test_a_run_moves_over_from_a_checkpoint_hf_wrote(tmp_path, stop_at, hf_uninterrupted):
    """transformers.Trainer trains and saves checkpoint-N; the drop-in resumes from it and ends
    where HF's uninterrupted run ends: the same later logs and final weights."""
    train, evaluation = lm_rows(28, seed=3), lm_rows(8, seed=4)
    kw = dict(save_strategy="steps", save_steps=stop_at, **MOVE_OVER)
    model = tiny_llama(seed=2)
    whole = hf_uninterrupted
    cut = HFTrainer(
        model=copy.deepcopy(model),
        args=args_for(tmp_path / "hf", **kw),
        train_dataset=train,
        eval_dataset=evaluation,
        callbacks=[Recorder(stop_at=stop_at)],
    )
    cut.train()
    folder = tmp_path / "hf" / f"checkpoint-{stop_at}"
    written = sorted(p.name for p in folder.iterdir())
    assert "training_args.bin" in written and "optimizer.pt" in written
    moved = Trainer(
        model=tiny_llama(seed=9),
        args=args_for(tmp_path / "hf", **kw),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    moved.train(resume_from_checkpoint=str(folder))
    assert moved.state.global_step == whole.state.global_step == 14
    later = [h for h in whole.state.log_history if h["step"] > stop_at]
    assert_same_history(later, [h for h in moved.state.log_history if h["step"] > stop_at])
    assert [h["step"] for h in moved.state.log_history][: len(cut.state.log_history) - 1] == [
        h["step"] for h in cut.state.log_history[:-1]
    ]  # HF's history up to the checkpoint came along
    assert_same_weights(whole.model, moved.model)
    assert sorted(p.name for p in folder.iterdir()) == written  # HF's checkpoint left as it was


def test_hyperparameter_search_as_hf(tmp_path):
    """HF's hyperparameter_search with the same seeded Optuna sampler: the same trials, the same
    objectives (eval loss) and the same best run."""
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    train, evaluation = lm_rows(16, seed=3), lm_rows(8, seed=4)

    def hp_space(trial):
        return {
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 3e-2, log=True),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [2, 4]),
        }

    best = {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        trainer = cls(
            model_init=lambda: tiny_llama(seed=1),
            args=args_for(tmp_path / name, max_steps=3),
            train_dataset=train,
            eval_dataset=evaluation,
        )
        best[name] = trainer.hyperparameter_search(
            hp_space=hp_space, n_trials=3, direction="minimize", sampler=optuna.samplers.TPESampler(seed=0)
        )
    assert best["cl"].run_id == best["hf"].run_id
    assert best["cl"].hyperparameters == best["hf"].hyperparameters
    assert best["cl"].objective == pytest.approx(best["hf"].objective, rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "cl").iterdir() if p.name.startswith("run-")) == [
        "run-0",
        "run-1",
        "run-2",
    ]


def test_save_model_and_save_state_write_what_hf_reads_and_no_pickle(tmp_path):
    from transformers import LlamaForCausalLM

    trainer = Trainer(
        model=tiny_llama(), args=args_for(tmp_path / "run", max_steps=2), train_dataset=lm_rows(8)
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    trainer.save_state()
    names = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"model.safetensors", "config.json", "training_args.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl")) for n in names)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_weights(trainer.model, loaded, atol=0)
    import json

    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["log_history"] == trainer.state.log_history


def test_a_rerun_into_the_same_output_dir_starts_over_with_a_warning(tmp_path):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=1)
    Trainer(model=tiny_llama(), args=args_for(tmp_path, **kw), train_dataset=lm_rows(8)).train()
    assert (tmp_path / "checkpoint-2").is_dir()
    again = Trainer(
        model=tiny_llama(), args=args_for(tmp_path, **{**kw, "save_steps": 5}), train_dataset=lm_rows(8)
    )
    with pytest.warns(
        UserWarning, match="holds an earlier run .*checkpoint-1, checkpoint-2.*resume_from_checkpoint=True"
    ):
        again.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-2"
    ]  # the new run's save at the end


def test_report_to_mlflow_from_the_drop_in_reads_back_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    """HF's MLflowCallback runs through the bridge, as HF runs it: the metrics read back from a
    real MLflow store equal corelooper's metrics.jsonl, step by step."""
    pytest.importorskip("mlflow")
    import json

    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trainer = Trainer(
        model=tiny_llama(),
        args=args_for(
            tmp_path / "run",
            max_steps=6,
            logging_steps=2,
            eval_strategy="steps",
            eval_steps=3,
            report_to="mlflow",
        ),
        train_dataset=lm_rows(24),
        eval_dataset=lm_rows(8, seed=2),
    )
    trainer.train()
    client = MlflowClient(store)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "eval_loss", "learning_rate"):
        expected = [(h["step"], h[key]) for h in logged if key in h]
        got = [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)]
        assert len(got) == len(expected) >= 2, key
        for (gs, gv), (es, ev) in zip(got, expected, strict=True):
            assert gs == es and gv == pytest.approx(ev, rel=1e-6), key


def test_export_config_writes_the_arguments_as_a_config_corelooper_runs_with_the_same_train(tmp_path):
    """The step from a script to a config: Trainer.export_config and `corelooper hf-export-config`
    (the real CLI, on save_model's training_args.json) write the same [train]; with [model]/[data]
    filled in, the config validates to the TrainArgs the drop-in ran with."""
    import subprocess
    import sys
    from pathlib import Path

    import tomllib
    from corelooper_hf.trainer.convert import train_args

    from corelooper.config import Config

    args = args_for(
        tmp_path / "run",
        max_steps=2,
        learning_rate=3e-4,
        lr_scheduler_type="cosine",
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        report_to="none",
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=lm_rows(8), eval_dataset=lm_rows(4))
    written = trainer.export_config(tmp_path / "config.toml")
    train = tomllib.loads(written.read_text())["train"]
    assert train["learning_rate"] == 3e-4 and train["lr_scheduler_type"] == "cosine"
    assert "adam_beta1" not in train  # HF's defaults are left out
    assert "# [model]" in written.read_text()
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    cli = Path(sys.executable).with_name("corelooper")
    out = tmp_path / "from_cli.toml"
    proc = subprocess.run(
        [str(cli), "hf-export-config", str(tmp_path / "final" / "training_args.json"), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "corelooper run" in proc.stdout
    assert tomllib.loads(out.read_text())["train"] == train
    filled = (
        out.read_text()
        .replace("# [model]\n# factory", "[model]\nfactory")
        .replace("# [data]\n# train", "[data]\ntrain")
    )
    out.write_text(filled)
    config = Config.load(out)
    expected = train_args(args)
    for key in (
        "learning_rate",
        "lr_scheduler_type",
        "gradient_accumulation_steps",
        "eval_steps",
        "max_steps",
    ):
        assert getattr(config.train, key) == getattr(expected, key), key
    bad = subprocess.run(
        [str(cli), "hf-export-config", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "missing.json" in bad.stderr and "Traceback" not in bad.stderr


class KwargsRecorder(TrainerCallback):
    """What HF's CallbackHandler passes each event: the kwargs given (not None) and their types;
    at step 2 it asks for a save and an evaluation through control, as HF's test_stateful_control."""

    def __init__(self):
        self.seen: dict[str, set] = {}


def _kwargs_event(name):
    def method(self, args, state, control, **kwargs):
        given = {k: v for k, v in kwargs.items() if v is not None}
        typed = {(k, type(v).__name__) for k, v in given.items() if k in ("model", "logs", "metrics")}
        self.seen.setdefault(name, set()).update({*given, *typed})
        if name == "on_step_end" and state.global_step == 2:
            control.should_save = True
            control.should_evaluate = True

    return method


for _name in EVENTS:
    setattr(KwargsRecorder, _name, _kwargs_event(_name))


def test_callbacks_get_hfs_kwargs_and_their_control_flags_are_obeyed(tmp_path):
    train, evaluation = lm_rows(16, seed=3), lm_rows(8, seed=4)
    seen, folders = {}, {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        recorder = KwargsRecorder()
        trainer = cls(
            model=tiny_llama(),
            args=args_for(tmp_path / name, max_steps=4, save_strategy="no", eval_strategy="no"),
            train_dataset=train,
            eval_dataset=evaluation,
            callbacks=[recorder],
        )
        trainer.train()
        seen[name] = recorder.seen
        folders[name] = sorted(p.name for p in (tmp_path / name).glob("checkpoint-*"))
        assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2]
    assert set(seen["cl"]) == set(seen["hf"])
    for event, hf_kwargs in seen["hf"].items():
        names = {k for k in hf_kwargs if isinstance(k, str)}
        typed = {k for k in hf_kwargs if isinstance(k, tuple) and k[0] in ("model", "logs", "metrics")}
        assert names <= seen["cl"][event], event  # every kwarg HF gives, given
        assert typed <= seen["cl"][event], event  # the same model class, logs and metrics dicts
    assert folders["cl"] == folders["hf"] == ["checkpoint-2"]  # the callback's should_save obeyed


# -- every override and constructor function, called as HF calls it ----------------------------------


def recording_subclass(base, calls: list):
    """A subclass overriding each method HF documents for customising, recording each call (and
    the arguments HF passes) before doing what HF does."""

    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            calls.append(("training_step", sorted(inputs), int(num_items_in_batch)))
            return super().training_step(model, inputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            calls.append(("prediction_step", sorted(inputs), prediction_loss_only))
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

        def get_train_dataloader(self):
            calls.append(("get_train_dataloader",))
            return super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset=None):
            calls.append(("get_eval_dataloader",))
            return super().get_eval_dataloader(eval_dataset)

        def create_optimizer(self, model=None):
            calls.append(("create_optimizer",))
            return super().create_optimizer(model) if base is Trainer else super().create_optimizer()

        def create_scheduler(self, num_training_steps, optimizer=None):
            calls.append(("create_scheduler", num_training_steps))
            return super().create_scheduler(num_training_steps, optimizer)

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            calls.append(("evaluate", metric_key_prefix))
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

        def log(self, logs, start_time=None):
            calls.append(("log", sorted(k for k in logs if k in ("loss", "eval_loss", "train_loss"))))
            logs["custom"] = 1.0  # what a log override typically adds: it reaches the history
            super().log(logs, start_time)

    return Recording


def test_every_documented_override_runs_with_hfs_arguments(tmp_path):
    train, evaluation = lm_rows(16, seed=3), lm_rows(8, seed=4)
    model = tiny_llama(seed=1)
    calls, trainers = {"hf": [], "cl": []}, {}
    for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
        trainer = recording_subclass(cls, calls[name])(
            model=copy.deepcopy(model),
            args=args_for(
                tmp_path / name,
                max_steps=4,
                gradient_accumulation_steps=2,
                eval_strategy="steps",
                eval_steps=2,
            ),
            train_dataset=train,
            eval_dataset=evaluation,
        )
        trainer.train()
        trainers[name] = trainer
    kinds = {n: [c[0] for c in calls[n]] for n in calls}
    for kind in ("training_step", "prediction_step", "create_scheduler", "evaluate", "log"):
        assert [c for c in calls["cl"] if c[0] == kind] == [c for c in calls["hf"] if c[0] == kind], kind
    for kind in ("get_train_dataloader", "create_optimizer", "get_eval_dataloader"):
        assert kind in kinds["cl"] and kind in kinds["hf"], kind
    assert all("custom" in h for h in trainers["cl"].state.log_history)
    assert_same_history(trainers["hf"].state.log_history, trainers["cl"].state.log_history)
    assert_same_weights(trainers["hf"].model, trainers["cl"].model)


class MeanLossModel(torch.nn.Module):
    """Not an HF model: forward takes no loss kwargs and returns the batch's mean loss, so HF divides
    each micro-batch's loss by the accumulation steps (and counts label positions unshifted)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
            )
        return out


def test_the_constructor_functions_and_a_non_hf_model_as_hf(tmp_path):
    """compute_loss_func, optimizers=(optimizer, scheduler), optimizer_cls_and_kwargs and
    preprocess_logits_for_metrics, each with the same inputs to both classes."""
    train, evaluation = lm_rows(15, seed=3), lm_rows(8, seed=4)  # 15 rows: a short last micro-batch

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"][:, :-1].float()
        total = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        return total / num_items_in_batch

    def argmax(logits, labels):
        return logits.argmax(-1)

    def metrics(eval_pred):
        return {"mean_prediction": float(eval_pred.predictions.mean())}

    cases = {
        "non_hf_model": lambda m: dict(),
        "compute_loss_func": lambda m: dict(compute_loss_func=loss_func),
        "optimizer_cls_and_kwargs": lambda m: dict(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05})),
        "optimizers": lambda m: dict(
            optimizers=(
                opt := torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
            )
        ),
        "preprocess_logits": lambda m: dict(compute_metrics=metrics, preprocess_logits_for_metrics=argmax),
    }
    for case, extra in cases.items():
        out = {}
        for name, cls in (("hf", HFTrainer), ("cl", Trainer)):
            model = MeanLossModel()
            trainer = cls(
                model=model,
                args=args_for(
                    tmp_path / case / name,
                    num_train_epochs=1,
                    gradient_accumulation_steps=2,
                    logging_steps=1,
                    eval_strategy="steps",
                    eval_steps=1,
                ),
                train_dataset=train,
                eval_dataset=evaluation,
                **extra(model),
            )
            trainer.train()
            out[name] = trainer
        assert_same_history(out["hf"].state.log_history, out["cl"].state.log_history)
        assert_same_weights(out["hf"].model, out["cl"].model)
        if case == "preprocess_logits":
            assert any("eval_mean_prediction" in h for h in out["cl"].state.log_history)


def test_trainer_log_called_by_user_code_reaches_the_history_and_corelooper_loggers(tmp_path):
    """A compute_loss override that logs its own value every step (a common HF pattern): the same
    log_history entries as HF, and the values in corelooper's metrics.jsonl too."""
    import json

    def logging_loss(base):
        class LoggingLoss(base):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                if model.training:
                    self.log({"my_tokens": float(inputs["attention_mask"].sum())})
                return result

        return LoggingLoss

    runs = run_both(tmp_path, trainer_kw=dict(train_dataset=lm_rows(12)), subclass=logging_loss, max_steps=3)
    (hf, hf_rec, _), (cl, cl_rec, _) = runs["hf"], runs["cl"]
    mine = [[(h["step"], h["my_tokens"]) for h in t.state.log_history if "my_tokens" in h] for t in (hf, cl)]
    assert mine[1] == mine[0] and len(mine[0]) == 3
    assert cl_rec.events == hf_rec.events
    logged = [json.loads(line) for line in (tmp_path / "cl" / "metrics.jsonl").read_text().splitlines()]
    assert [(h["step"], h["my_tokens"]) for h in logged if "my_tokens" in h] == mine[1]
