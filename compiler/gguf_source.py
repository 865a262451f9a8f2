"""A GGUF file (llama.cpp, Ollama) as a checkpoint: its tensors under Hugging Face names,
dequantized one at a time as they are read.

Everything that knows GGUF is the `gguf` library and transformers' own GGUF support:
`load_gguf_checkpoint` (metadata only) gives the config, `AutoTokenizer.from_pretrained(...,
gguf_file=)` the tokenizer (saved as tokenizer.json, tokenizer_config.json and
chat_template.jinja), `get_gguf_hf_weights_map` the tensor names, and the architecture's
`TensorProcessor` undoes what llama.cpp's converter did to a tensor (the q/k row permutation
of llama-family weights, BLOOM's fused-qkv layout, GPT-2's transposes, Gemma's norm offset).
`gguf.GGUFReader` lists the tensors (types, shapes, offsets); their bytes are read with plain
file reads (a memory map's touched pages would count in the compile's RSS, as for
safetensors), dequantized with `gguf.quants.dequantize` to float32 and handed to the
compiler, which casts them to the artifact's dtype. Peak memory is one tensor in float32 and
its bytes as stored, beside what the safetensors route holds.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from dsc.errors import UserError


def is_gguf(model) -> bool:
    return isinstance(model, (str, Path)) and str(model).endswith(".gguf") and Path(model).is_file()


def _require_gguf(path: Path):
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(f"{path}: reading GGUF files needs the gguf package (pip install 'dsc[gguf]')") from None


class GGUFTensors:
    """The tensors of one GGUF file that the model loads, by Hugging Face name."""

    def __init__(self, path: Path, reader, processor, gguf_names: dict[str, str], shapes: dict[str, tuple]):
        self.path, self._processor = path, processor
        self._by_name = {t.name: t for t in reader.tensors}
        self.gguf_names = gguf_names  # HF name -> GGUF name
        self.shapes = shapes  # HF name -> shape
        self._key_map = {g: h for h, g in gguf_names.items()}

    def spans(self) -> list[tuple[int, int, str]]:
        """(first byte, end byte, HF name) of every tensor in the file, in file order."""
        out = []
        for hf, g in self.gguf_names.items():
            t = self._by_name[g]
            out.append((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), hf))
        return sorted(out)

    def four_bit_blocks(self, name: str) -> bool:
        """Whether the file stores tensor `name` in 4-bit blocks of 32 (Q4_0, Q4_1): --int4's
        groups of 32 then hold the same values (Q4_1's exactly)."""
        t = self._by_name.get(self.gguf_names.get(name, ""))
        return t is not None and t.tensor_type.name in ("Q4_0", "Q4_1")

    def decoded_bytes(self, name: str) -> int:
        return 4 * math.prod(self.shapes[name])

    def decode(self, name: str, raw: torch.Tensor) -> torch.Tensor:
        """The float32 tensor `name` from its bytes as the file stores them (uint8 [n_bytes])."""
        from gguf import dequantize

        t = self._by_name[self.gguf_names[name]]
        data = raw.numpy().view(t.data.dtype).reshape(t.data.shape)  # the layout GGUFReader gives it
        parsed: dict = {"tensors": {}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = self._processor.process(
                weights=dequantize(data, t.tensor_type),
                name=t.name,
                tensor_key_mapping=self._key_map,
                parsed_parameters=parsed,
            )
        out = parsed["tensors"].get(name)  # a processor that stores the tensor itself (GPT-2's head)
        if out is None:
            out = torch.from_numpy(np.ascontiguousarray(res.weights, dtype=np.float32))
        out = out.float()
        if tuple(out.shape) != self.shapes[name]:
            raise UserError(
                f"{self.path}: tensor '{t.name}' ({name}) has shape {list(out.shape)}, "
                f"the model's config implies {list(self.shapes[name])}"
            )
        return out

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name`, read from the file with plain reads and decoded."""
        t = self._by_name[self.gguf_names[name]]
        raw = torch.empty(int(t.n_bytes), dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(int(t.data_offset))
            if f.readinto(raw.numpy()) != raw.numel():
                raise UserError(f"{self.path}: truncated GGUF file")
        return self.decode(name, raw)


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)


def _weights_map(lm, processor) -> dict[str, str]:
    """transformers' GGUF -> HF tensor names for the model `lm`. get_gguf_hf_weights_map builds
    gguf's name table again for every submodule it recurses into (seconds on a 30-layer model);
    the table depends only on (architecture, layers), so it is built once here.
    [HACK: remove when transformers' get_gguf_hf_weights_map builds the table once]"""
    import functools
    from unittest import mock

    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with mock.patch("gguf.get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map)):
        return get_gguf_hf_weights_map(lm, processor)


_PARSED: dict = {}  # (path, inode, size, mtime_ns) -> (GGUFReader, load_gguf_checkpoint's dict): the last file read


def _parsed(path: Path):
    """(GGUFReader, transformers' metadata dict) of the GGUF file `path`, parsed once: the
    reader's field table is what load_gguf_checkpoint and the tokenizer's loader would each
    parse again (seconds on a real model's vocabulary). Kept for the last file this process
    read, keyed by its identity and modification time, so compiling it again skips the parse;
    the dict is handed out as a copy (callers may change it)."""
    from unittest import mock

    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _PARSED.get(key)
    if hit is None:
        try:
            reader = GGUFReader(path)
        except (ValueError, OSError, IndexError) as e:
            raise UserError(
                f"{path}: not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else None

        def same_reader(p, *args, **kwargs):  # load_gguf_checkpoint's reader: the one above
            if Path(p).resolve() == path.resolve() and not args and not kwargs:
                return reader
            return GGUFReader(p, *args, **kwargs)

        try:
            with mock.patch("gguf.GGUFReader", same_reader):
                parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        except ValueError as e:  # transformers' "GGUF model with architecture X is not supported yet."
            raise UserError(f"{path}: GGUF architecture {arch!r} is not one transformers can load ({e})") from None
        _PARSED.clear()
        _PARSED[key] = hit = (reader, parsed)
    return hit[0], copy.deepcopy(hit[1])


def _load_gguf_checkpoint_from(path: Path, parsed: dict):
    """transformers' load_gguf_checkpoint, answering for `path` (metadata only) with a copy of
    `parsed`, and reading any other file itself."""
    from transformers import modeling_gguf_pytorch_utils

    original = modeling_gguf_pytorch_utils.load_gguf_checkpoint

    def load(gguf_checkpoint_path, return_tensors=False, **kwargs):
        if Path(gguf_checkpoint_path).resolve() == path.resolve() and not return_tensors and not kwargs:
            return copy.deepcopy(parsed)
        return original(gguf_checkpoint_path, return_tensors=return_tensors, **kwargs)

    return load


def open_gguf(path: Path, folder: Path):
    """A Checkpoint over the GGUF file `path`: config.json and the tokenizer's files written
    into `folder` (which must outlive the compile), the weights read from the file."""
    from dsc.compiler.source import Checkpoint, TensorInfo

    path = Path(path)
    _require_gguf(path)
    from unittest import mock

    from gguf import dequantize
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    reader, parsed = _parsed(path)
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else None
    cfg = dict(parsed["config"])
    model_type = cfg.pop("model_type", None)
    from dsc.compiler.architectures import ARCHITECTURES

    if model_type not in ARCHITECTURES:
        raise UserError(
            f"{path}: GGUF architecture {arch!r} (model_type {model_type!r}) is not one dsc "
            f"compiles; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    for t in reader.tensors:  # every quant type dequantizes (checked on one row)
        try:
            dequantize(t.data[:1], t.tensor_type)
        except NotImplementedError:
            raise UserError(
                f"{path}: tensor '{t.name}' is quantized as {t.tensor_type.name}, which the "
                "installed gguf library cannot dequantize"
            ) from None
    config = AutoConfig.for_model(model_type, **cfg)
    folder = Path(folder)
    config.save_pretrained(folder)
    try:
        with mock.patch(
            "transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint", _load_gguf_checkpoint_from(path, parsed)
        ):  # its config from the metadata parsed above
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:  # one transformers cannot convert
        print(f"warning: {path}: compiled without a tokenizer (transformers cannot convert it: {e})", file=sys.stderr)
    else:
        tok.save_pretrained(folder)
        for extra in ("special_tokens_map.json", "added_tokens.json"):
            (folder / extra).unlink(missing_ok=True)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    lm = _meta_model(config)
    to_hf = _weights_map(lm, processor)  # GGUF name -> HF name
    shapes = {n: tuple(p.shape) for n, p in lm.state_dict(keep_vars=True).items()}
    present = {t.name for t in reader.tensors}
    gguf_names = {hf: g for g, hf in sorted(to_hf.items()) if g in present and hf in shapes}
    if not gguf_names:
        raise UserError(f"{path}: none of the file's tensors maps to a {model_type} parameter")
    tensors = GGUFTensors(path, reader, processor, gguf_names, {n: shapes[n] for n in gguf_names})
    ckpt = Checkpoint(
        root=folder, name=str(path), config=json.loads((folder / "config.json").read_text()), files=[path]
    )
    ckpt.gguf = tensors
    for hf in gguf_names:
        ckpt.tensors[hf] = TensorInfo(path, "F32", tensors.shapes[hf])
    return ckpt
