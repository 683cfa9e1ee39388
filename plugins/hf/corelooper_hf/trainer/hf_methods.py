"""The HF ``Trainer`` methods a subclass overrides, with HF's bodies (transformers 5.25), on corelooper.

``HFMethods`` is the drop-in ``Trainer``'s half that users customise: ``compute_loss``,
``training_step`` (one micro-batch: forward, loss, backward), ``prediction_step``,
``evaluation_loop``, ``log``, ``create_optimizer``, ``create_scheduler`` and the dataloader getters.
The drop-in's providers call these (``corelooper_hf.trainer.providers``), so an override in a
subclass is what the run does, called with HF's arguments. They read HF's attributes
(``self.args``, ``self.model_accepts_loss_kwargs``, ``self.label_smoother``, ...) and reach the
hardware through ``self.accelerator``, a view of the corelooper backend with accelerate's names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class AcceleratorView:
    """The few ``Accelerator`` names HF ``Trainer`` code uses, answered by the run's corelooper
    backend. ``backward`` also fires corelooper's ``on_before_backward`` / ``on_after_backward``."""

    def __init__(self, loop) -> None:
        self.loop = loop

    @property
    def backend(self):
        return self.loop.backend

    num_processes = property(lambda self: self.backend.num_processes)
    process_index = property(lambda self: self.backend.process_index)
    local_process_index = property(lambda self: self.backend.local_process_index)
    is_main_process = property(lambda self: self.backend.is_main_process)
    is_local_main_process = property(lambda self: self.backend.is_local_main_process)
    device = property(lambda self: self.backend.device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.loop.events.fire("on_before_backward", loss=loss)
        self.backend.backward(loss)
        self.loop.events.fire("on_after_backward", loss=loss)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        return self.backend.unwrap_model(model)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.backend.gather(tensor if tensor.dim() else tensor[None])

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return self.backend.reduce_sum(tensor) if reduction == "sum" else self.backend.reduce_mean(tensor)

    def no_sync(self, model):
        return self.backend.no_sync(model)

    def wait_for_everyone(self) -> None:
        self.backend.wait_for_everyone()


class HFMethods:
    """HF's overridable ``Trainer`` methods. The attributes they read are set by ``Trainer``."""

    # -- the step ---------------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch: forward, loss, backward; the detached loss (HF's ``training_step``)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:  # normalised by num_items_in_batch, by the model or by compute_loss_func
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled and self.current_gradient_accumulation_steps != 1:  # x / 1 is x, bit for bit
            loss = loss / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()

    def compute_loss(
        self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None
    ):
        """HF's ``compute_loss``: the model's loss, ``compute_loss_func``, or label smoothing."""
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        else:
            labels = None
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            shift = self._is_causal_lm()  # as HF: the model's class is a causal LM
            loss = self.label_smoother(
                outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch
            )
        else:
            if isinstance(outputs, dict) and "loss" not in outputs:
                raise ValueError(
                    "The model did not return a loss from the inputs, only the following keys: "
                    f"{','.join(outputs.keys())}. For reference, the inputs it received are "
                    f"{','.join(inputs.keys())}."
                )
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if (
            self.args.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func)
            and num_items_in_batch is not None
        ):
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        return (loss, outputs) if return_outputs else loss

    def _is_causal_lm(self) -> bool:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = self.accelerator.unwrap_model(self.model)
        base = getattr(getattr(model, "base_model", None), "model", None)
        name = (base if hasattr(model, "peft_config") and base is not None else model)._get_name()
        return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def _prepare_inputs(self, inputs: dict) -> dict:
        """The micro-batch on the run's device (HF's ``_prepare_inputs``)."""
        inputs = self.accelerator.backend.to_device(inputs)
        if len(inputs) == 0:
            raise ValueError(
                "The batch received was empty, your model won't be able to train on it. Double-check that your "
                f"training dataset contains keys expected by the model: {','.join(self._signature_columns())}."
            )
        return inputs

    def get_num_items_in_batch(self, batch_samples: list):
        """Loss-bearing items of one optimizer step over all processes (HF's ``_get_num_items_in_batch``)."""
        counting = (
            batch_samples
            and "labels" in batch_samples[0]
            and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        )
        if not counting:
            return None
        try:
            labels = [
                b["shift_labels"]
                if "shift_labels" in b
                else b["labels"][..., 1:]
                if self._loss_shifts_labels
                else b["labels"]
                for b in batch_samples
            ]
            count = sum(lab.ne(-100).sum() for lab in labels)
        except (TypeError, AttributeError):
            return None
        device = self.accelerator.device
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            count = self.accelerator.backend.reduce_sum(count.to(device))
        return count.to(device) if torch.is_tensor(count) else count

    # -- optimizer and schedule ---------------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The optimizer: the one given (``optimizers=``), ``optimizer_cls_and_kwargs`` over HF's
        parameter groups, or HF's ``optim`` by name (corelooper's, with HF's values)."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            if self.optimizer_cls_and_kwargs is not None:
                cls, kwargs = self.optimizer_cls_and_kwargs
                self.optimizer = cls(self._parameter_groups(model), **kwargs)
            else:
                from corelooper.hf.optimizers import create_optimizer

                self.optimizer = create_optimizer(self._loop, model)
        return self.optimizer

    def _parameter_groups(self, model) -> list[dict]:
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]

    def get_decay_parameter_names(self, model) -> list[str]:
        from transformers.trainer_pt_utils import get_parameter_names

        forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
        return get_parameter_names(model, [nn.LayerNorm], forbidden)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The learning-rate schedule: the one given, else HF's ``lr_scheduler_type`` (corelooper's)."""
        if self.lr_scheduler is None:
            from corelooper.hf.schedules import create_scheduler

            optimizer = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = create_scheduler(self._loop.args, optimizer, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    # -- data ---------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """This process's training batches: corelooper's seeded, resumable loader, in HF's order
        (seeded as HF's sampler) and drawing from torch's generator as a DataLoader does."""
        from .providers import DrawsAsTorchLoader

        loop = self._loop
        loader = loop.plugins.call_next(
            "train_dataloader", self._providers, loop=loop, dataset=loop.train_dataset
        )[0]
        if hasattr(loader, "seed"):
            loader.seed = self.sampler_seed
        return DrawsAsTorchLoader(loader)

    def get_eval_dataloader(self, eval_dataset=None):
        """This process's evaluation batches: in dataset order on one process; on several, the
        batches accelerate deals HF's Trainer (``eval_shards.EvenBatches``)."""
        loop = self._loop
        dataset = self._for_model(eval_dataset) if eval_dataset is not None else loop.eval_dataset
        backend = loop.backend
        if backend.num_processes > 1:
            from .eval_shards import EvenBatches

            size = self.args.per_device_eval_batch_size
            return EvenBatches(
                dataset, size, loop.data_collator, backend.process_index, backend.num_processes
            )
        return loop.plugins.call_next("eval_dataloader", self._providers, loop=loop, dataset=dataset)[0]

    def get_test_dataloader(self, test_dataset):
        return self.get_eval_dataloader(test_dataset)

    # -- evaluation ---------------------------------------------------------------------------------
    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        """(loss, logits, labels) of one evaluation batch (HF's ``prediction_step``)."""
        from transformers.trainer_pt_utils import nested_detach

        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.get("return_loss")
        return_loss = self.can_return_loss if return_loss is None else return_loss
        loss_without_labels = not self.label_names and return_loss
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = (
                getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []
            )
        labels = None
        if has_labels or loss_without_labels:
            labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad():
            if has_labels or loss_without_labels:
                num_items = self.get_num_items_in_batch([inputs])
                loss, outputs = self.compute_loss(
                    model, inputs, return_outputs=True, num_items_in_batch=num_items
                )
                loss = loss.detach().mean()
                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
                else:
                    logits = outputs[1:]
            else:
                loss = None
                outputs = model(**inputs)
                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
                else:
                    logits = outputs
        if prediction_loss_only:
            return (loss, None, None)
        logits = nested_detach(logits)
        if len(logits) == 1:
            logits = logits[0]
        return (loss, logits, labels)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only=None,
        ignore_keys=None,
        metric_key_prefix="eval",
    ):
        """Every batch through ``prediction_step``; the sample-weighted mean loss, the gathered
        predictions and labels, and ``compute_metrics`` (HF's ``evaluation_loop``)."""
        from transformers.trainer_pt_utils import find_batch_size
        from transformers.trainer_utils import EvalLoopOutput

        loss_only = (
            prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        )
        model = self._loop.model
        model.eval()
        if hasattr(self.optimizer, "eval") and callable(self.optimizer.eval):
            self.optimizer.eval()
        self.callback_handler.eval_dataloader = dataloader
        losses, preds, labels, seen, batch_size = [], [], [], 0, None
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            from .providers import draw_as_torch_dataloader

            draw_as_torch_dataloader()  # as a torch DataLoader's pass draws: HF's random stream after it
        kept = getattr(dataloader, "kept", lambda i: None)  # a round's real samples (EvenBatches)
        for i, inputs in enumerate(dataloader):
            observed = find_batch_size(inputs)
            if observed is not None:
                seen += observed
                batch_size = observed if batch_size is None else batch_size
            loss, logits, label = self.prediction_step(model, inputs, loss_only, ignore_keys=ignore_keys)
            if loss is not None:  # each sample once: HF's gather_for_metrics drops a short batch's padding
                losses.append(self._gather_batch(loss.repeat(observed or batch_size), kept(i)))
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, label)
            if logits is not None:
                preds.append(self._gather_batch(logits, kept(i)))
            if label is not None:
                labels.append(self._gather_batch(label, kept(i)))
            self._loop.events.fire("on_prediction_step", batch=inputs, outputs=None)
        all_preds, all_labels = self._gathered(preds), self._gathered(labels)
        metrics = self._metrics(all_preds, all_labels)
        if losses:
            metrics[f"{metric_key_prefix}_loss"] = torch.cat(losses).double().mean().item()
        if self.model_preparation_time is not None:
            metrics[f"{metric_key_prefix}_model_preparation_time"] = self.model_preparation_time
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        num_samples = len(dataloader.dataset) if hasattr(dataloader, "dataset") else seen
        return EvalLoopOutput(
            predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=num_samples
        )

    def _metrics(self, preds, labels) -> dict:
        from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

        if self.compute_metrics is None or preds is None or labels is None:
            return {}
        return denumpify_detensorize(
            self.compute_metrics(EvalPrediction(predictions=preds, label_ids=labels))
        )

    def _gather_batch(self, value, kept: int | None):
        """One batch's tensor(s) from every process in rank order (dim 1 padded with -100 to the
        longest, HF's ``pad_across_processes``), the round's real rows only, on the CPU."""
        if self.accelerator.num_processes > 1:
            value = _gather_padded(value, self.accelerator)
        value = _detached_cpu(value)
        return value if kept is None else _rows(value, kept)

    def _gathered(self, chunks: list):
        """The gathered batches, padded with -100 and concatenated, as numpy."""
        if not chunks:
            return None
        from transformers.trainer_pt_utils import nested_concat, nested_numpify

        out = chunks[0]
        for chunk in chunks[1:]:
            out = nested_concat(out, chunk, padding_index=-100)
        return nested_numpify(out)

    def speed_metrics(self, prefix: str, started: float, num_samples: int) -> dict[str, float]:
        from transformers.trainer_utils import speed_metrics

        total_batch = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        return speed_metrics(
            prefix, started, num_samples=num_samples, num_steps=math.ceil(num_samples / total_batch)
        )

    # -- FLOPs (HF's total_flos) --------------------------------------------------------------------
    def floating_point_ops(self, inputs: dict) -> int:
        """HF's estimate for one micro-batch: 6 x parameters (without embeddings) x input tokens."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input in inputs and hasattr(self.model, "num_parameters"):
            if self._flos_parameters is None:  # HF counts them every micro-batch; they do not change
                self._flos_parameters = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main_input].numel() * self._flos_parameters
        return 0

    def store_flos(self) -> None:
        """This session's FLOPs into ``state.total_flos`` (every process counted as this one)."""
        self.state.total_flos += self.current_flos * self.accelerator.num_processes
        self.current_flos = 0

    # -- logs ---------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record ``logs`` in ``state.log_history`` and tell the callbacks (HF's ``Trainer.log``).

        Called with every training and evaluation log of the run (corelooper's ``on_log``). Called
        by user code during training, the values also reach corelooper's loggers (``metrics.jsonl``
        and logger plugins) as a log of the current step."""
        if not self._bridge_logging and self._loop.is_training:
            self._loop.log(dict(logs))  # comes back here through on_log, HF's way
            return
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen not in ("no", False):
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                from transformers.trainer_utils import speed_metrics

                logs.update(speed_metrics("train", start_time, num_tokens=self.state.num_input_tokens_seen))
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)


def _detached_cpu(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_detached_cpu(v) for v in value)
    return value.detach().cpu() if torch.is_tensor(value) else value


def _rows(value, n: int):
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, n) for v in value)
    return value[:n]


def _gather_padded(value, accelerator):
    """``value`` from every process in rank order, dim 1 padded with -100 to the longest (HF's
    ``pad_across_processes`` + ``gather``)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_padded(v, accelerator) for v in value)
    backend = accelerator.backend
    if value.dim() > 1:
        sizes = torch.zeros(backend.num_processes, device=backend.device)
        sizes[backend.process_index] = value.shape[1]
        longest = int(backend.reduce_sum(sizes).max())
        if value.shape[1] < longest:
            pad = value.new_full((value.shape[0], longest - value.shape[1], *value.shape[2:]), -100)
            value = torch.cat([value, pad], dim=1)
    return backend.gather(value.to(backend.device)).cpu()
