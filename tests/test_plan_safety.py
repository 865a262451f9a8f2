"""A crafted plan.json (its manifest re-hashed, as an attacker would) is refused at load with one
line naming the node and the field, before any graph is built: op names resolve only through the
table of ops dsc emits, names/targets/keys must be (dotted) identifiers, tags come from a fixed
list. Every payload here would create the file `pwned` in the working directory if it ran."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsc
from dsc.errors import UserError
from dsc.runtime import plan as plan_format

MARKER = "pwned"  # relative, no dots: a weight target is split on "." by FX before it is written


@pytest.fixture(scope="module")
def small_artifact(compile_artifact):
    return compile_artifact("llama-tiny", dtype="fp32", max_seq=16, max_batch=2)


def _rehash(art: Path, rel: str) -> None:
    m = json.loads((art / "manifest.json").read_text())
    m["files"][rel] = hashlib.sha256((art / rel).read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(m))


def _edit_plan(art: Path, edit, programs: tuple[str, ...] = ("prefill",)) -> None:
    plan = json.loads((art / "plan.json").read_text())
    for p in programs:
        edit(plan["programs"][p]["nodes"])
    (art / "plan.json").write_text(json.dumps(plan))
    _rehash(art, "plan.json")


def _first(nodes: list[dict], kind: str) -> dict:
    return next(n for n in nodes if n["kind"] == kind)


def _insert_after_inputs(nodes: list[dict], new: list[dict]) -> None:
    i = max(i for i, n in enumerate(nodes) if n["kind"] in ("input", "weight"))
    nodes[i + 1 : i + 1] = new


def _call(name: str, op: str, *args, **kwargs) -> dict:
    return {"name": name, "kind": "call", "op": op, "args": list(args), "kwargs": kwargs}


def _exec_chain(nodes: list[dict]) -> None:
    """operator.attrgetter + operator.call reach builtins.exec from the input tensor's class."""
    x = _first(nodes, "input")["name"]
    _insert_after_inputs(
        nodes,
        [
            _call("a", "operator.attrgetter", "__class__.__repr__.__globals__"),
            _call("b", "operator.call", {"node": "a"}, {"node": x}),
            _call("c", "operator.getitem", {"node": "b"}, "__builtins__"),
            _call("d", "operator.getitem", {"node": "c"}, "exec"),
            _call("e", "operator.call", {"node": "d"}, f"open({MARKER!r}, 'w').close()"),
        ],
    )


def _op_named(op: str, *args):
    def edit(nodes):
        _insert_after_inputs(nodes, [_call("evil", op, *args)])

    return edit


def _kwargs_key(key: str):
    """A key the FX code generator writes as `<key> = value` inside the call: a line break ends
    the statement and starts the attacker's."""

    def edit(nodes):
        n = next(n for n in nodes if n["kind"] == "call" and n["op"] == "aten.view.default")
        n["kwargs"][key] = 1

    return edit


def _node_name(name: str):
    def edit(nodes):
        n = _first(nodes, "input")
        old = n["name"]
        n["name"] = name
        text = json.dumps(nodes).replace(json.dumps({"node": old}), json.dumps({"node": name}))
        nodes[:] = json.loads(text)

    return edit


def _tag(tag: str, value: str):
    def edit(nodes):
        n = next(n for n in nodes if n["kind"] == "call" and n["op"] == "aten.view.default")
        n["kwargs"]["dtype"] = {tag: value}

    return edit


LINE_BREAK_PAYLOAD = f"x=1) if 0 else None\r    open({MARKER!r}, 'w').close()\r    _ = dict(z"
CASES = {
    "op_attrgetter_chain_to_exec": (_exec_chain, ["'a'", "op", "operator.attrgetter"]),
    "op_builtins_exec": (
        _op_named("builtins.exec", f"open({MARKER!r}, 'w').close()"),
        ["'evil'", "op", "builtins.exec"],
    ),
    "op_torch_load": (_op_named("torch.load", MARKER), ["'evil'", "op", "torch.load"]),
    "op_unknown_aten": (_op_named("aten.save.default", MARKER), ["'evil'", "op", "aten.save.default"]),
    "op_other_namespace": (_op_named("profiler._record_function_enter.default", "x"), ["'evil'", "op"]),
    "kwargs_key_carriage_return": (_kwargs_key(LINE_BREAK_PAYLOAD), ["kwargs", "key"]),
    "kwargs_key_newline": (_kwargs_key(LINE_BREAK_PAYLOAD.replace("\r", "\n")), ["kwargs", "key"]),
    "kwargs_key_quote": (_kwargs_key("a'b"), ["kwargs", "key"]),
    "kwargs_key_python_keyword": (_kwargs_key("lambda"), ["kwargs", "key"]),
    "node_name_line_break": (_node_name("input_ids\r    open('pwned', 'w').close()"), ["name"]),
    "dtype_tag_outside_list": (_tag("dtype", "load"), ["dtype", "load"]),
    "layout_tag_outside_list": (_tag("layout", "set_default_device"), ["layout"]),
    "unknown_tag": (_tag("module", "os"), ["module"]),
}


def _load_and_run(art: Path):
    engine = dsc.load(art, device="cpu")
    engine.generate([[1, 2, 3]], max_new_tokens=2)


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_plan_is_refused_before_any_code_runs(case, tmp_path, small_artifact, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(small_artifact, art)
    edit, names = CASES[case]
    _edit_plan(art, edit)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        _load_and_run(art)
    msg = str(e.value)
    assert "\n" not in msg and "plan.json" in msg, msg
    for name in names:
        assert name in msg, (name, msg)
    assert not (tmp_path / MARKER).exists()


def test_weight_target_with_a_line_break_is_refused(tmp_path, small_artifact, monkeypatch):
    """The target is written into `getattr(self, "<part>")`; the rank file is crafted to hold a
    tensor of that name so that the load reaches the code generator."""
    art = tmp_path / "art"
    shutil.copytree(small_artifact, art)
    target = f'x", None)\r    open({MARKER!r}, "w")\r    _ = ("'
    nodes = json.loads((art / "plan.json").read_text())["programs"]["prefill"]["nodes"]
    old = _first(nodes, "weight")["target"]
    tensors = load_file(art / "rank0.safetensors")
    tensors[target] = tensors.pop(old)
    save_file(tensors, art / "rank0.safetensors")
    _rehash(art, "rank0.safetensors")

    def edit(nodes):
        for n in nodes:
            if n.get("target") == old:
                n["target"] = target

    _edit_plan(art, edit, ("prefill", "decode"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="target") as e:
        _load_and_run(art)
    assert "\n" not in str(e.value)
    assert not (tmp_path / MARKER).exists()


def test_every_op_of_the_golden_plans_is_in_the_table():
    from dsc.kernels import registry

    golden = Path(__file__).parent / "golden"
    ops = {
        tok
        for f in golden.glob("*.plan.txt")
        for line in f.read_text().splitlines()
        for tok in line.split()[1:2]
        if tok.split(".")[0] in ("aten", "dsc", "operator", "math", "torch")
    }
    assert {"aten.linear.default", "dsc.attention.default", "operator.getitem"} <= ops
    assert all(registry.is_known(op) for op in ops), sorted(op for op in ops if not registry.is_known(op))


def test_the_table_resolves_to_the_ops_the_compiler_names():
    from dsc.kernels import registry

    names = [*registry.ATEN_OPS, *registry.PYTHON_OPS, *(n for n in registry.DECLARED_OPS if n.startswith("dsc."))]
    for name in names:
        assert registry.is_known(name) and registry.op_name(registry.resolve_op(name)) == name
    assert not registry.is_known("dsc_onnx.dequantize.default")  # export-only, never in a plan


def test_a_real_plan_still_builds(small_artifact):
    plan = json.loads((small_artifact / "plan.json").read_text())
    for program in plan["programs"].values():
        g, targets = plan_format.build_graph(program["nodes"], torch.device("cpu"))
        assert targets and any(n.op == "call_function" for n in g.nodes)


def _program(*calls: dict) -> list[dict]:
    return [
        {"name": "x", "kind": "input"},
        {"name": "w", "kind": "weight", "target": "model.w"},
        *calls,
        {"name": "output", "kind": "output", "args": {"node": calls[-1]["name"]}},
    ]


@pytest.mark.parametrize(
    "call, words",
    [
        (_call("v", "aten.view.default", {"node": "x"}, [2, 3], shape=[2, 3]), ["'v'", "kwargs", "shape"]),
        (_call("v", "aten.view.default", {"node": "x"}, [2, 3], 4), ["'v'", "at most 2 positional"]),
        (_call("v", "aten.view.default", "x", [2, 3]), ["'v'", "argument self", "'x'"]),
        (_call("v", "aten.view.default", {"node": "later"}, [2]), ["'v'", "refers to 'later'"]),
        (_call("g", "operator.getitem", {"node": "x"}, "__class__"), ["'g'", "operator.getitem takes"]),
        (_call("g", "operator.getitem", {"node": "x"}, 0, 1), ["'g'", "operator.getitem takes"]),
        (_call("m", "aten.mean.dim", {"node": "x"}, [-1], {"dtype": "float32", "x": 1}), ["'m'", "encoded argument"]),
        (_call("m", "aten.mean.dim", {"node": "x"}, [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]), ["'m'", "nested"]),
    ],
)
def test_arguments_are_of_the_kinds_the_op_accepts(call, words):
    with pytest.raises(UserError) as e:
        plan_format.build_graph(_program(call), torch.device("cpu"))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_well_formed_call_of_each_kind_builds():
    nodes = _program(
        _call("s", "aten.sym_size.int", {"node": "x"}, 0),
        _call("n", "operator.mul", {"node": "s"}, 2),
        _call("v", "aten.view.default", {"node": "x"}, [{"node": "n"}, -1]),
        _call("c", "aten.to.dtype", {"node": "v"}, {"dtype": "float16"}),
        _call("a", "aten.arange.default", 4, device={"device": "target"}, dtype={"dtype": "int64"}),
        _call("f", "aten.add.Tensor", {"node": "c"}, {"float": "-inf"}),
    )
    g, targets = plan_format.build_graph(nodes, torch.device("cpu"))
    assert targets == ["model.w"] and len([n for n in g.nodes if n.op == "call_function"]) == 6
