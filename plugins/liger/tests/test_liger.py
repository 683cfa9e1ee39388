"""corelooper-liger: opt-in like HF's use_liger_kernel, inactive with one reason where the kernels
cannot run (this machine and CI have no CUDA GPU), clear config errors, and the real patch call on a
tiny Llama.

What cannot exist here: a CUDA GPU, so no Triton kernel runs — no forward of a patched model is
made (Triton has no CPU backend). The patch itself swaps module methods and runs on any machine; it
is checked in a subprocess, because Liger also replaces functions of ``transformers``' llama module
for the whole process, which would reach the other tests' Llama models.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import corelooper_liger
import pytest
import torch

from corelooper.config import TrainArgs
from corelooper.errors import ConfigError

CORELOOPER = Path(sys.executable).parent / "corelooper"
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
# On a GPU the patch runs instead of the no-CUDA report these tests read; that path is
# benchmarks/gpu/'s cl_bf16_liger step (Triton kernels cannot run on a CPU).
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA")

TASK = """
import torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def train_set():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return [(x[i], int(x[i].sum() > 0)) for i in range(32)]
"""


def write_config(tmp_path: Path, train: str = "", liger: str | None = None) -> Path:
    (tmp_path / "task.py").write_text(TASK)
    section = f"[liger]\n{liger}\n" if liger is not None else ""
    config = tmp_path / "config.toml"
    config.write_text(
        textwrap.dedent(f"""\
        [model]
        factory = "{tmp_path / "task.py"}:model"
        [data]
        train = "{tmp_path / "task.py"}:train_set"
        [train]
        output_dir = "{tmp_path / "run"}"
        max_steps = 2
        per_device_train_batch_size = 8
        save_strategy = "no"
        disable_tqdm = true
        report_to = "none"
        {train}
        """)
        + section
    )
    return config


def cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """The real ``corelooper`` command; ``prelude``: Python run first in the same process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)
    if not prelude:
        return subprocess.run([str(CORELOOPER), *args], capture_output=True, text=True, timeout=300, env=env)
    code = f"{prelude}\nimport sys\nfrom corelooper.cli.app import main\nsys.argv = ['corelooper', *{list(args)!r}]\nmain()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def liger_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("  liger ")]
    return line


@pytest.mark.slow
@no_cuda
def test_cli_reports_inactive_without_a_section_and_without_cuda(tmp_path):
    none = cli("plugins", "--config", str(write_config(tmp_path)))
    assert none.returncode == 0, none.stderr
    assert liger_line(none.stdout).endswith(
        "inactive for this config: no [liger] section (or train.use_liger_kernel = true)]"
    )
    asked = cli("plugins", "--config", str(write_config(tmp_path, liger="rms_norm = true")))
    assert asked.returncode == 0, asked.stderr
    line = liger_line(asked.stdout)
    assert line.startswith("  liger (corelooper-liger 0.2.0) [installed, inactive for this config: ")
    if HAS_LIGER:
        assert "no CUDA GPU here: Liger's Triton kernels run on CUDA GPUs only" in line
    else:
        assert "liger-kernel is not installed: pip install liger-kernel" in line
    assert "config [liger]: enabled=True, rope=None, rms_norm=True" in asked.stdout


def test_cli_names_the_package_when_liger_kernel_is_missing(tmp_path):
    # An entry of None in sys.modules makes `import liger_kernel` fail and find_spec() answer None:
    # the process sees no liger-kernel, as on a machine without it.
    out = cli(
        "plugins",
        "--config",
        str(write_config(tmp_path, liger="")),
        prelude="import sys; sys.modules['liger_kernel'] = None",
    )
    assert out.returncode == 0, out.stderr
    assert liger_line(out.stdout).endswith(
        "inactive for this config: liger-kernel is not installed: pip install liger-kernel "
        "(Linux with a CUDA GPU; it brings triton)]"
    )


@pytest.mark.slow
@no_cuda
def test_run_asking_for_liger_on_cpu_warns_once_and_trains_the_model_as_is(tmp_path):
    config = write_config(tmp_path, train="use_liger_kernel = true")
    out = cli("run", str(config))
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [x for x in out.stderr.splitlines() if "Liger kernels not applied" in x]
    assert len(warnings) == 1, out.stderr[-3000:]
    assert ("no CUDA GPU here" if HAS_LIGER else "liger-kernel is not installed") in warnings[0]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r and "train_runtime" not in r]  # it trained


def test_hf_names_become_the_section():
    from corelooper.config import Config

    args = TrainArgs(use_liger_kernel=True, liger_kernel_config={"rope": False, "layer_norm": True})
    assert dict(Config(train=args).sections["liger"]) == {
        "enabled": True,
        "rope": False,
        "extra": {"layer_norm": True},
    }
    # As HF: false (its default) needs nothing, and a config without use_liger_kernel patches nothing.
    assert "liger" not in Config(train=TrainArgs(use_liger_kernel=False)).sections
    alone = TrainArgs(liger_kernel_config={"swiglu": True})
    assert dict(Config(train=alone).sections["liger"]) == {"enabled": False, "swiglu": True}
    with pytest.raises(ConfigError, match="train.use_liger_kernel must be true or false"):
        TrainArgs(use_liger_kernel="yes")
    with pytest.raises(ConfigError, match=r"\[liger\] enabled = False contradicts the HF name"):
        Config(train=TrainArgs(use_liger_kernel=True), sections={"liger": {"enabled": False}})


@pytest.mark.parametrize(
    ("section", "train", "match"),
    [
        ({"rms_nrom": True}, {}, r"Unknown key liger.rms_nrom. Did you mean 'rms_norm'"),
        ({"rope": "yes"}, {}, r"liger.rope = 'yes': must be true, false, or left out"),
        ({"cross_entropy": True, "fused_linear_cross_entropy": True}, {}, "not both"),
        ({"extra": {"swiglu": False}}, {}, r"\[liger\] extra sets \['swiglu'\], which are \[liger\] keys"),
        ({}, {"lm": {"loss": "chunked"}}, "lm.loss = 'chunked' and Liger's fused linear cross-entropy"),
        ({"fused_linear_cross_entropy": True}, {"lm": {"loss": "chunked"}}, "Choose one"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(make_loop, section, train, match):
    with pytest.raises(ConfigError, match=match):
        make_loop([corelooper_liger], sections={"liger": section, **train})


@no_cuda  # on a GPU the patch would run, and the tiny task's model is not a transformers model
def test_chunked_loss_with_liger_other_kernels_is_accepted(make_loop):
    loop = make_loop(
        [corelooper_liger],
        sections={"liger": {"fused_linear_cross_entropy": False}, "lm": {"loss": "chunked"}},
    )
    assert loop.plugins.get(corelooper_liger.RUN_PLUGIN_NAME) is None
    assert loop.plugins.inactive["liger"].startswith(
        "no CUDA GPU here" if HAS_LIGER else "liger-kernel is not"
    )
    disabled = make_loop(
        [corelooper_liger], sections={"liger": {"enabled": False}, "lm": {"loss": "chunked"}}
    )
    assert disabled.plugins.inactive["liger"] == "[liger] enabled = false"


def test_a_model_that_is_not_a_transformers_model_is_refused():
    with pytest.raises(ConfigError, match="patches Hugging Face transformers models; Linear is not one"):
        corelooper_liger.apply(torch.nn.Linear(2, 2), {})


PATCH = """
import json, transformers, torch, corelooper_liger
from corelooper.data.columns import forward_signature
from corelooper.errors import ConfigError

def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)

out = {}
plain, m = llama(), llama()  # both built before any patch
import peft
wrapped = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
out["applied"] = corelooper_liger.apply(m, {"rope": True, "swiglu": True, "geglu": True})
out["norms"] = sorted({mod._get_name() for name, mod in m.named_modules() if name.endswith("norm")})
out["mlp"] = m.model.layers[1].mlp._get_name()
out["forward"] = m.forward.__func__.__module__ + "." + m.forward.__func__.__name__
out["loss_kwargs"] = forward_signature(m).accepts_loss_kwargs  # so corelooper passes num_items_in_batch
corelooper_liger.apply(plain, {"rms_norm": False, "fused_linear_cross_entropy": False})
out["plain"] = [plain.model.norm._get_name(), type(plain).forward is plain.forward.__func__]
out["later"] = type(llama().model.norm).__name__  # Liger replaced the class in modeling_llama
corelooper_liger.apply(wrapped, {})
out["peft_base_norm"] = wrapped.get_base_model().model.norm._get_name()
gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
try:
    corelooper_liger.apply(gpt2, {})
except ConfigError as e:
    out["gpt2"] = str(e)
print(json.dumps(out))
"""


# On Linux the plugin depends on liger-kernel: a missing install fails here. Elsewhere triton has
# no wheels, the plugin installs without it, and there is nothing to patch with.
@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_LIGER and sys.platform != "linux",
    reason="liger-kernel (triton) has Linux wheels only; the plugin declares it only there",
)
def test_patch_call_on_a_tiny_llama_replaces_its_modules_and_forward():
    # No forward afterwards: Triton kernels need a CUDA GPU (see the module docstring).
    p = subprocess.run(
        [sys.executable, "-c", PATCH],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["applied"] == {"rope": True, "swiglu": True}  # geglu is not a llama switch: ignored
    assert "'geglu'] not switches of Liger's llama patch: ignored" in p.stderr
    assert out["norms"] == ["LigerRMSNorm"]  # every layer's two norms and the final one
    assert out["mlp"] == "LigerSwiGLUMLP"
    assert out["forward"] == "liger_kernel.transformers.model.llama.lce_forward"  # no logits in training
    assert out["loss_kwargs"] is True
    assert out["plain"] == ["LlamaRMSNorm", True]  # switched off: the instance keeps its own
    assert out["later"] == "LigerRMSNorm"  # process-wide, as the README's limits say
    assert out["peft_base_norm"] == "LigerRMSNorm"  # through the PEFT wrapper, as HF's Trainer
    assert "no kernels for model type 'gpt2'" in out["gpt2"] and "llama" in out["gpt2"]
