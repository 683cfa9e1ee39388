"""One function per contender: ``fn(model, train, h) -> None`` trains ``model`` in place on the
samples ``train`` for one epoch with the shared hyper-parameters ``h`` (see run_one.py), and
returns the seconds spent preparing data (inside the framework, before its loop) if it can
tell them apart; the caller times the whole call.

Shared: AdamW (the fused kernel: the default of all three frameworks), linear decay, no warm-up,
no weight decay, clipping at 1.0, one epoch, batch ``h.batch`` samples (packed rows: ``h.rows``
rows of ``h.max_len`` tokens), no eval or checkpoint during training, fp32 on CPU; on a GPU
(``h.cpu`` False) bf16 autocast for every row (``h.bf16``), each framework moving the model itself.

corelooper's packed and padding-free rows take their layout by name (``--cl-packing``):

* ``collators``: what ``corelooper_lm.collators`` offers today — ``pack_sequences`` (best-fit
  decreasing) with a 1-D attention mask and restarted ``position_ids``, as ``PackedDataset``
  builds them. With sdpa attention, packed samples attend to each other (it leaks).
  No padding-free path exists there.
* ``packing``: ``corelooper_lm.packing`` (the leak-free packing of the SFT work): ``plan_packing``
  + ``SegmentCollator`` (4-D block-diagonal causal mask for sdpa/eager; varlen for flash).
  Padding-free = one row per batch of the same ``h.batch`` samples, segments kept apart.
* ``auto`` (default): ``packing`` when ``corelooper_lm.packing`` can be imported, else
  ``collators`` (and the padding-free row is skipped, saying why).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import types
from types import SimpleNamespace

import common as C


class Unavailable(Exception):
    """This contender cannot run in this environment (the reason is reported, not hidden)."""


def import_framework(method: str) -> None:
    """Import what ``method``'s framework imports, before the timed call: the HF Trainer's and
    TRL's calls would otherwise pay for importing ``transformers.Trainer``/accelerate/trl/datasets
    inside the clock while corelooper's pays for ``corelooper``: not the same window."""
    if method.startswith(("hf_", "trl_")):
        import transformers.tokenization_utils_tokenizers  # noqa: F401  (Trainer() imports it)
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments  # noqa: F401
    if method.startswith("trl_"):
        import datasets  # noqa: F401  (the HF rows pass lists: only TRL's need it)
        from trl import SFTConfig, SFTTrainer  # noqa: F401
    if method.startswith("raw_"):
        import corelooper_lm.packing  # noqa: F401
        import corelooper_lm.segment_attention  # noqa: F401

        import corelooper.data.loader  # noqa: F401
    if method.startswith("cl_"):
        import corelooper_lm.collators  # noqa: F401
        import corelooper_lm.packing  # noqa: F401
        import corelooper_lm.segment_attention  # noqa: F401

        from corelooper import Loop, TrainArgs  # noqa: F401

        import_corelooper_modules()


def import_corelooper_modules() -> None:
    """Every module of corelooper and of the plugins ``Loop()`` registers: ``Loop()`` and its
    plugins' hooks import theirs lazily (``--help`` imports no torch), so without this the timed
    call would import ~20-30 modules the HF Trainer's and TRL's calls have imported already."""
    import importlib
    import pkgutil

    from corelooper.plugins import load_plugins

    packages = {"corelooper"}
    for plugin in load_plugins().pm.get_plugins():
        module = plugin if isinstance(plugin, types.ModuleType) else sys.modules.get(type(plugin).__module__)
        if module is not None:
            packages.add(module.__name__.split(".")[0])
    for name in sorted(packages):
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(
            getattr(package, "__path__", []), f"{name}.", onerror=lambda _: None
        ):
            if info.name.endswith("__main__"):  # `python -m`'s entry: importing it would run the CLI
                continue
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 (a module whose optional dependency is absent: not imported by the run either)
                pass


def hf_args(h, out: str, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        num_train_epochs=1,
        per_device_train_batch_size=extra.pop("batch", h.batch),
        learning_rate=h.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=h.cpu,
        seed=h.seed,
        dataloader_num_workers=0,
        bf16=h.bf16,
        **extra,
    )


def as_rows(train):
    return [
        {"input_ids": s.input_ids, "attention_mask": [1] * len(s.input_ids), "labels": s.labels}
        for s in train
    ]


# -- Hugging Face Trainer ----------------------------------------------------------------------


def _hf(model, train, h, **extra):
    from transformers import DataCollatorForSeq2Seq, Trainer

    out = tempfile.mkdtemp(prefix="sft-hf-")
    collator = DataCollatorForSeq2Seq(C.make_tokenizer(), padding="longest", label_pad_token_id=-100)
    trainer = Trainer(
        model=model, args=hf_args(h, out, **extra), train_dataset=as_rows(train), data_collator=collator
    )
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)


def hf_padded(model, train, h):
    _hf(model, train, h)


def hf_grouped(model, train, h):
    # transformers 5.x: TrainingArguments(group_by_length=True) is gone; the length-grouped
    # sampler is train_sampling_strategy="group_by_length" (LengthGroupedSampler).
    _hf(model, train, h, train_sampling_strategy="group_by_length")


def _hf_flat(model, train, h):
    """HF's documented padding-free path: ``DataCollatorWithFlattening`` (one row per batch,
    ``position_ids`` restarting per sample, ``cu_seq_lens`` for varlen kernels)."""
    from transformers import DataCollatorWithFlattening, Trainer

    out = tempfile.mkdtemp(prefix="sft-hf-")
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rows = [{"input_ids": s.input_ids, "labels": s.labels} for s in train]
    trainer = Trainer(model=model, args=hf_args(h, out), train_dataset=rows, data_collator=collator)
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)


def hf_flattening(model, train, h):
    # stock sdpa: transformers turns the restarting position_ids into a T x T block mask
    _hf_flat(model, train, h)


def hf_flattening_seg(model, train, h):
    """The same, with the attention kernel of corelooper's padding-free row (segment-wise sdpa,
    what flash-attention varlen is on a GPU): the peer given corelooper's kernel."""
    with same_kernel_as_corelooper(model):
        _hf_flat(model, train, h)


# -- TRL SFTTrainer ----------------------------------------------------------------------------


def _trl(model, train, h, **extra):
    import datasets
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    out = tempfile.mkdtemp(prefix="sft-trl-")
    batch = extra.pop("batch", h.batch)
    args = SFTConfig(
        output_dir=out,
        num_train_epochs=1,
        per_device_train_batch_size=batch,
        learning_rate=h.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=h.cpu,
        seed=h.seed,
        dataloader_num_workers=0,
        # SFTConfig defaults to bf16 and gradient checkpointing: ~10x slower on CPU, and not what
        # the other rows do. On the GPU script they are set explicitly per row.
        bf16=h.bf16,
        gradient_checkpointing=False,
        **extra,
    )
    ds = datasets.Dataset.from_list([{"input_ids": s.input_ids, "labels": s.labels} for s in train])
    t = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=C.make_tokenizer())
    prep = time.perf_counter() - t
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)
    return prep


def trl_padded(model, train, h):
    return _trl(model, train, h, max_length=h.max_len)


def trl_padding_free(model, train, h):
    # TRL: padding_free without packing does not enforce max_length (it must be None); the data
    # is already <= max_len.
    return _trl(model, train, h, padding_free=True, max_length=None)


def trl_grouped(model, train, h):
    # TRL documents the HF sampler option: padded batches of similar length
    return _trl(model, train, h, max_length=h.max_len, train_sampling_strategy="group_by_length")


def trl_padding_free_seg(model, train, h):
    """TRL's padding-free row with corelooper's attention kernel (TRL documents padding_free for
    flash attention: on CPU the segment-wise sdpa is that kernel's stand-in)."""
    with same_kernel_as_corelooper(model):
        return _trl(model, train, h, padding_free=True, max_length=None)


def trl_packing_bfd(model, train, h):
    return _trl(model, train, h, packing=True, packing_strategy="bfd", max_length=h.max_len, batch=h.rows)


class same_kernel_as_corelooper:  # noqa: N801 (a context manager used like a function)
    """Switch ``model``'s sdpa to corelooper's segment-wise sdpa for the block, back after it."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        try:
            from corelooper_lm.segment_attention import use_segment_attention
        except ImportError as e:
            raise Unavailable(
                f"corelooper_lm.segment_attention is not installed ({e}): pip install -e plugins/lm"
            ) from e
        use_segment_attention(self.model)

    def __exit__(self, *exc):
        _back_to_sdpa(self.model)


# -- hand-written loop ---------------------------------------------------------------------------


def raw_padding_free(model, train, h):
    """A hand-written loop over corelooper's padding-free layout and batches (the same samples per
    batch, in the order of corelooper's sampler for this seed, one unpadded row, segment-wise sdpa),
    computing every position: the model's own loss (``labels``), its lm_head over every token.
    fused AdamW, linear decay, clip 1.0, one epoch, as every row."""
    import torch

    from corelooper.data.loader import epoch_permutation

    device = torch.device("cpu" if h.cpu else "cuda")
    model.to(device)
    seg = _leak_free_collator(model, h)
    order = epoch_permutation(len(train), h.seed, 0, True)
    batches = [order[i : i + h.batch] for i in range(0, len(order), h.batch)]
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / len(batches)))
    model.train()
    try:
        for idx in batches:
            batch = seg([_segments([train[i] for i in idx])])
            batch = {
                k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
            }
            n = (batch["labels"][:, 1:] != -100).sum()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=h.bf16):
                loss = model(**batch, num_items_in_batch=n).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    finally:
        _back_to_sdpa(model)


# -- corelooper ----------------------------------------------------------------------------------


def _loop(model, dataset, h, collator, **train):
    from corelooper import Loop, TrainArgs
    from corelooper.config import Config

    out = tempfile.mkdtemp(prefix="sft-cl-")
    args = TrainArgs(
        output_dir=out,
        num_train_epochs=1,
        per_device_train_batch_size=train.pop("batch", h.batch),
        learning_rate=h.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        use_cpu=h.cpu,
        seed=h.seed,
        mixed_precision="bf16" if h.bf16 else "no",
        **train,
    )
    # [lm] head "trained" and the training token_accuracy: what an [sft] run does by default
    # (corelooper_lm.trained_head, corelooper_lm.accuracy; TRL's rows count mean_token_accuracy too)
    accuracy = getattr(h, "cl_token_accuracy", True)
    lm = {"head": train_head(h), "token_accuracy": accuracy, "loss": getattr(h, "cl_loss", "default")}
    config = Config(train=args, sections={"lm": lm})
    loop = Loop(model, config, train_dataset=dataset, data_collator=collator)
    loop.train()
    shutil.rmtree(out, ignore_errors=True)


def train_head(h) -> str:
    """``--cl-head``: "trained" (default, as in corelooper-sft runs) or "all" (every position)."""
    return getattr(h, "cl_head", "trained")


def _cl_items(train):
    return [{"input_ids": s.input_ids, "prompt_length": s.prompt_length} for s in train]


def cl_padded(model, train, h):
    from corelooper_lm.collators import DataCollatorForCausalLM

    _loop(model, _cl_items(train), h, DataCollatorForCausalLM(pad_token_id=C.PAD))


def cl_grouped(model, train, h):
    from corelooper_lm.collators import DataCollatorForCausalLM

    _loop(model, _cl_items(train), h, DataCollatorForCausalLM(pad_token_id=C.PAD), group_by_length=True)


def packing_layout(h) -> str:
    if h.cl_packing != "auto":
        return h.cl_packing
    try:
        import corelooper_lm.packing  # noqa: F401
    except ImportError:
        return "collators"
    return "packing"


def _packed_rows_collators(train, h):
    """corelooper_lm.collators.pack_sequences (today's PackedDataset plan), prompt-masked: the plan
    is made over encoded (sample, position) ids so each piece maps back to its sample."""
    import torch
    from corelooper_lm.collators import pack_sequences

    stride = h.max_len + 1
    encoded = [[i * stride + p for p in range(len(s.input_ids))] for i, s in enumerate(train)]
    bins = pack_sequences(encoded, h.max_len, strategy="bfd")
    rows = []
    for pieces in bins:
        ids = torch.full((h.max_len,), C.PAD, dtype=torch.long)
        labels = torch.full((h.max_len,), -100, dtype=torch.long)
        mask = torch.zeros(h.max_len, dtype=torch.long)
        pos = torch.zeros(h.max_len, dtype=torch.long)
        at = 0
        for j, piece in enumerate(pieces):
            s = train[piece[0] // stride]
            k = len(piece)
            ids[at : at + k] = torch.tensor(s.input_ids)
            labels[at : at + k] = torch.tensor(s.labels)
            if j > 0:
                labels[at] = -100
            mask[at : at + k] = 1
            pos[at : at + k] = torch.arange(k)
            at += k
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos})
    return rows


def _segments(samples):
    from corelooper_lm.packing import Segment

    return [Segment(input_ids=s.input_ids, labels=s.labels, extras={}) for s in samples]


def _leak_free_collator(model, h):
    """``SegmentCollator`` for the model's attention: with ``--cl-attention segments`` (default)
    the model's sdpa becomes corelooper's segment-wise sdpa (one unpadded row per batch, each
    segment attending to itself: ``sum(L_i^2)`` scores, no mask); ``mask``: the 4-D boolean
    block-diagonal mask over the whole row (``T^2`` scores)."""
    from corelooper_lm.packing import SegmentCollator

    attn = "sdpa"
    if getattr(h, "cl_attention", "segments") == "segments":
        try:
            from corelooper_lm.segment_attention import use_segment_attention
        except ImportError:
            pass
        else:
            attn = use_segment_attention(model)
    return SegmentCollator(
        pad_token_id=C.PAD, attn_implementation=attn, mask_dtype=next(model.parameters()).dtype
    )


def _back_to_sdpa(model):
    """The eval loss is measured with the attention every contender has (sdpa)."""
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        model.set_attn_implementation("sdpa")


def cl_packed(model, train, h):
    t = time.perf_counter()
    if packing_layout(h) == "collators":
        rows = _packed_rows_collators(train, h)
        collator = None  # torch's default collate stacks the fixed-length rows
    else:
        from corelooper_lm.packing import plan_packing

        plan = plan_packing([len(s.input_ids) for s in train], h.max_len, "bfd")
        rows = [
            _segments(
                [C.Sample(train[i].input_ids[a:b], max(0, train[i].prompt_length - a)) for i, a, b in row]
            )
            for row in plan
        ]
        collator = _leak_free_collator(
            model, h
        )  # items are rows (lists of segments); a batch is a list of rows
    prep = time.perf_counter() - t
    if collator is None:
        import torch

        collator = lambda items: {k: torch.stack([it[k] for it in items]) for k in items[0]}  # noqa: E731
    try:
        _loop(model, rows, h, collator, batch=h.rows)
    finally:
        _back_to_sdpa(model)
    return prep


def cl_padding_free_all(model, train, h):
    """corelooper's padding-free row with the head over every position (``[lm] head = "all"``):
    the split between layout and head in the README comes from this row and cl_padding_free."""
    h = SimpleNamespace(**{**vars(h), "cl_head": "all"})
    return cl_padding_free(model, train, h)


def cl_padding_free_all_no_accuracy(model, train, h):
    """cl_padding_free_all without the training ``token_accuracy`` (a diagnostic, in no goal): what
    that metric costs, and what the framework costs without it (lockstep.py)."""
    h = SimpleNamespace(**{**vars(h), "cl_token_accuracy": False})
    return cl_padding_free_all(model, train, h)


def cl_padding_free_chunked(model, train, h):
    """cl_padding_free with ``[lm] loss = "chunked"`` (the head's logits a chunk of rows at a time,
    never all of them: corelooper_lm.chunked_ce): what a large-vocabulary run that runs out of
    memory is told to set (benchmarks/large_vocab)."""
    h = SimpleNamespace(**{**vars(h), "cl_loss": "chunked"})
    return cl_padding_free(model, train, h)


def cl_padding_free(model, train, h):
    if packing_layout(h) == "collators":
        raise Unavailable(
            "--cl-packing collators: corelooper_lm.collators has no padding-free path (it is in "
            "corelooper_lm.packing); pass --cl-packing packing or auto"
        )
    seg = _leak_free_collator(model, h)

    def collate(items):  # the same samples per batch as the padded row, flattened into one row
        return seg([_segments([C.Sample(it["input_ids"], it["prompt_length"]) for it in items])])

    try:
        _loop(model, _cl_items(train), h, collate)
    finally:
        _back_to_sdpa(model)


METHODS = {
    "hf_padded": hf_padded,
    "hf_grouped": hf_grouped,
    "hf_flattening": hf_flattening,
    "hf_flattening_seg": hf_flattening_seg,
    "trl_padded": trl_padded,
    "trl_grouped": trl_grouped,
    "trl_padding_free": trl_padding_free,
    "trl_padding_free_seg": trl_padding_free_seg,
    "trl_packing_bfd": trl_packing_bfd,
    "raw_padding_free": raw_padding_free,
    "cl_padded": cl_padded,
    "cl_grouped": cl_grouped,
    "cl_packed": cl_packed,
    "cl_padding_free": cl_padding_free,
    "cl_padding_free_all": cl_padding_free_all,
    "cl_padding_free_chunked": cl_padding_free_chunked,
    "cl_padding_free_all_no_accuracy": cl_padding_free_all_no_accuracy,
}
# Rows that give a peer corelooper's attention kernel: not one of its documented settings, so
# they are reported beside "best" (the best of each peer's documented settings), not inside it.
SAME_KERNEL = {"hf_flattening_seg", "trl_padding_free_seg"}
PACKED = {"trl_packing_bfd", "cl_packed"}


def hparams(**kw) -> SimpleNamespace:
    return SimpleNamespace(**kw)
