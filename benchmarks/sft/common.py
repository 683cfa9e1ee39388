"""What every SFT contender shares: the synthetic chat data, the tiny Llama, the eval loss, the
token counts. No download: the model is built from a config, the data is pre-tokenized ids.

Data: ``n`` samples with long-tailed lengths (log-normal, median ~64 tokens, clipped to 16-512),
a prompt of 20-60% of the sample (masked: labels -100) and a completion. Each sample belongs to
one of ``TOPICS`` topics: its first token names the topic; the topic uses its own random
``TOPIC_TOKENS`` of a shared pool of ``POOL`` tokens, and every next token is drawn from the
topic's own transition table (``SUCCESSORS`` successors per token). The pool is shared, so a
token alone does not say the topic: predicting a completion token well needs the topic marker at
the start of the sample's own sequence. A model whose attention leaks into other packed samples
(or whose positions are wrong) learns something else, and its eval loss shows it. Small enough
to be learnt in a few dozen steps (loss from ln 2048 = 7.6 towards ln 2 = 0.7).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

VOCAB = 2048
PAD, EOS = 0, 1
TOPICS = 16
FIRST_TOPIC_TOKEN = 2
POOL = 256
TOPIC_TOKENS = 64
SUCCESSORS = 2
MIN_LEN, MAX_LEN = 16, 512
DATA_SEED = 1234

# The tiny Llama (attention: sdpa; no KV cache in training: with one, Llama attends across
# packed samples). ~2.6M parameters; hidden/layers are options of run_one.py.
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=MAX_LEN,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=None,
    tie_word_embeddings=False,
)
# The large-vocabulary model (benchmarks/large_vocab): Qwen2's architecture with Qwen2.5's
# vocabulary, small body (hidden 256, 2 layers, GQA 4 heads / 2 KV heads), untied head. The data's
# ids stay < VOCAB: what grows is the head's work and its logits, the cost this model measures.
QWEN2_LARGE_VOCAB = dict(
    vocab_size=151_936,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=None,
    tie_word_embeddings=False,
)


# Qwen2.5-0.5B's shape, from a config (no download): the GPU plan's large-vocabulary row
# (benchmarks/gpu, step qwen05b_peers_bf16). Its embeddings are tied, as the released model's.
QWEN25_05B = dict(
    QWEN2_LARGE_VOCAB,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
ARCHS = {"qwen2": QWEN2_LARGE_VOCAB, "qwen2.5-0.5b": QWEN25_05B}


@dataclass
class Sample:
    input_ids: list[int]
    prompt_length: int

    @property
    def labels(self) -> list[int]:
        return [-100] * self.prompt_length + self.input_ids[self.prompt_length :]

    @property
    def trained(self) -> int:
        """Tokens in the loss (labels != -100 after the causal shift; the prompt is >= 1 token)."""
        return len(self.input_ids) - self.prompt_length


def _table(rng: random.Random) -> list[dict[int, list[int]]]:
    """Per topic: its tokens (a subset of the shared pool) -> their successors (in the subset)."""
    pool = list(range(FIRST_TOPIC_TOKEN + TOPICS, FIRST_TOPIC_TOKEN + TOPICS + POOL))
    tables = []
    for _ in range(TOPICS):
        subset = rng.sample(pool, TOPIC_TOKENS)
        tables.append({t: [rng.choice(subset) for _ in range(SUCCESSORS)] for t in subset})
    return tables


def _length(rng: random.Random) -> int:
    return max(MIN_LEN, min(MAX_LEN, int(math.exp(rng.gauss(math.log(64), 0.9)))))


def make_samples(n: int, split: str = "train", seed: int = DATA_SEED, length: int = 0) -> list[Sample]:
    """``split`` "train" / "eval": different samples from the same topics and tables. ``length``:
    every sample that many tokens (a fixed micro-batch of ``batch x length`` positions, for memory
    measurements; the prompt share is drawn as usual), else the long-tailed lengths."""
    table = _table(random.Random(seed))
    rng = random.Random(f"{seed}-{split}")
    out = []
    for _ in range(n):
        n_tokens, topic = length or _length(rng), rng.randrange(TOPICS)
        tok = rng.choice(sorted(table[topic]))
        ids = [FIRST_TOPIC_TOKEN + topic, tok]
        while len(ids) < n_tokens - 1:
            tok = rng.choice(table[topic][tok])
            ids.append(tok)
        ids.append(EOS)
        prompt = max(2, int(n_tokens * rng.uniform(0.2, 0.6)))
        out.append(Sample(ids, prompt))
    return out


def stats(samples: list[Sample]) -> dict:
    lengths = [len(s.input_ids) for s in samples]
    return dict(
        samples=len(samples),
        tokens=sum(lengths),
        trained_tokens=sum(s.trained for s in samples),
        mean_len=sum(lengths) / len(lengths),
        max_len=max(lengths),
        min_len=min(lengths),
    )


def make_model(seed: int, arch: str = "llama", **overrides):
    """``arch`` "llama": the tiny Llama (``MODEL``); "qwen2": the large-vocabulary Qwen2
    (``QWEN2_LARGE_VOCAB``); "qwen2.5-0.5b": Qwen2.5-0.5B's shape. ``overrides``: config fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        config, cls, base = LlamaConfig, LlamaForCausalLM, MODEL
    else:
        config, cls, base = Qwen2Config, Qwen2ForCausalLM, ARCHS[arch]
    cfg = config(**{**base, **overrides}, attn_implementation="sdpa", use_cache=False)
    return cls(cfg)


def make_tokenizer():
    """A word-level tokenizer over the ids "t0".."tN" (TRL's SFTTrainer wants a processing class;
    the data is already ids, so it is never used to tokenize)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<pad>"], vocab["</s>"] = PAD, EOS
    del vocab[f"t{PAD}"], vocab[f"t{EOS}"]
    tok = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def pad_batch(samples: list[Sample]):
    import torch

    n, length = len(samples), max(len(s.input_ids) for s in samples)
    ids = torch.full((n, length), PAD, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for r, s in enumerate(samples):
        k = len(s.input_ids)
        ids[r, :k] = torch.tensor(s.input_ids)
        labels[r, :k] = torch.tensor(s.labels)
        mask[r, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def eval_loss(model, samples: list[Sample], batch_size: int = 0) -> float:
    """Token-mean cross-entropy over the completions of ``samples``, padded batches (no packing:
    the same measurement for every contender), model in eval mode, no grad. ``batch_size`` 0: 16
    samples at the tiny Llama's vocabulary, fewer for a larger one (the same logits' size)."""
    import torch

    batch_size = batch_size or max(1, 16 * VOCAB // model.config.vocab_size)
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            b = {k: v.to(device) for k, v in pad_batch(samples[i : i + batch_size]).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            target = b["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                target.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            total += float(loss)
            count += int((target != -100).sum())
    model.train()
    return total / count


class Probe:
    """Counts what the model is fed (forward pre-hook): positions computed (``input_ids.numel()``),
    trained tokens (labels != -100 after the shift), forward calls. Same cost for every contender.

    A forward without ``labels`` (corelooper's head over trained positions: the loss is computed
    outside the model, from the logits of the trained positions only) counts the rows its output
    layer is handed, which are exactly the trained tokens there."""

    def __init__(self, model):
        self.positions = self.trained = self.forwards = 0
        self.trained_per_forward: list[int] = []
        self.threads_in_fwd = None  # what the framework left torch with during training
        self._unlabelled = False
        self._head_rows = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)
        model.register_forward_hook(self._after)
        model.get_output_embeddings().register_forward_pre_hook(self._head)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        labels = kwargs.get("labels")
        self._unlabelled = False
        if ids is None or not module.training:
            return
        if self.threads_in_fwd is None:
            import torch

            self.threads_in_fwd = torch.get_num_threads()
        self.forwards += 1
        self.positions += ids.numel()
        if labels is not None:  # a device tensor, read in summary(): no host-device sync per step
            self.trained_per_forward.append((labels[..., 1:] != -100).sum())
        else:
            self._unlabelled = True

    def _head(self, module, args):
        # the rows the output layer is handed (a chunked loss then hands it none and computes the
        # logits of those rows itself: corelooper_lm.chunked_ce)
        self._head_rows = args[0].shape[:-1].numel()

    def _after(self, module, args, out):
        if self._unlabelled:
            self.trained_per_forward.append(self._head_rows)
            self._unlabelled = False

    def summary(self) -> dict:
        self.trained_per_forward = [int(n) for n in self.trained_per_forward]
        self.trained = sum(self.trained_per_forward)
        return dict(
            forwards=self.forwards,
            positions_computed=self.positions,
            trained_tokens_fed=self.trained,
            threads_in_fwd=self.threads_in_fwd,
        )
