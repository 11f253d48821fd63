"""Rewrites a model directory's GroupQueryAttention nodes to ai.kvlayout with a chosen KV layout.

    from ort_kvlayout.tools.patch import patch_model_dir
    result = patch_model_dir("smollm2", "smollm2-seq-major", layout="seq-major")

What it does (DESIGN section 5):
- writes a new directory, atomically (a temporary sibling, renamed into place at the end); the
  input directory is never written to;
- copies every file (in the kernel: copy_file_range, a reflink on copy-on-write filesystems;
  or hard links with link=True); external-data files are never loaded: graphs are read with `onnx.load(..., load_external_data=False)` and written back as
  their protobuf, so the external-data references stay as they are;
- rewrites every `com.microsoft::GroupQueryAttention` (and every `ai.kvlayout` one, for a layout
  switch) to `ai.kvlayout` with `kv_layout`, keeping inputs, outputs and attributes, and adds the
  `("ai.kvlayout", 1)` opset import;
- copies the custom-op library into the directory and names it (relative) in genai_config.json
  `model.decoder.session_options.custom_ops_library`, so onnxruntime-genai runs the result as is;
- writes inference_metadata.yaml (ort_kvlayout.tools.metadata).

Nodes the op does not support (an fp8 KV cache without a quant type, output_qk, attributes
outside the contract, an inconsistent quantized-cache setup) are refused by name with the
reason (tools/node_checks.py), and then nothing is written. Quantized (int8 / packed int4 / fp8) nodes are kept,
k_scale/v_scale and the quant attributes unchanged: the CPU and CUDA ops run them (docs/TOOLS.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ..model.config import (
    GENAI_CONFIG,
    METADATA_FILE,
    SCALE_KEYS,
    MetadataError,
    config_int,
    json_type,
    load_genai_config,
)
from ..model.graph import (
    KV_LAYOUT_ATTR,
    GraphError,
    check_external_data,
    graph_facts,
    iter_gqa_nodes,
    load_model,
    node_kv_layout,
)
from ..op.layout import LAYOUT_NAMES, SEQ_MAJOR, layout_id
from ..op.library import DOMAIN, LIBRARY_NAME, library_path
from .kvquant import KvQuantError, check_scheme, convert_model, scale_names_for
from .metadata import build_metadata, current_umask, write_metadata
from .node_checks import check_model

OPSET_VERSION = 1

# Files at least this large are hard-linked rather than copied (weights, never written by a runtime).
LINK_MIN_BYTES = 16 << 20


class PatchError(RuntimeError):
    """The model directory cannot be patched; nothing was written."""


class UnsupportedNodeError(PatchError):
    """One or more GQA nodes use features the ai.kvlayout op does not support."""

    def __init__(self, refusals: list[tuple[str, str]]):
        self.refusals = refusals
        lines = [f"  {name}: {reason}" for name, reason in refusals]
        super().__init__(
            f"{len(refusals)} GroupQueryAttention node(s) cannot be patched:\n" + "\n".join(lines)
        )


@dataclass
class FileReport:
    """What happened to one ONNX file of the model directory."""

    path: str  # relative to the model directory
    gqa_nodes: int = 0
    rewritten: int = 0  # nodes whose domain or kv_layout changed


@dataclass
class PatchResult:
    model_dir: Path
    out_dir: Path
    layout: int
    files: list[FileReport] = field(default_factory=list)
    library: str | None = None  # file name inside out_dir
    metadata: Path | None = None

    @property
    def gqa_nodes(self) -> int:
        return sum(f.gqa_nodes for f in self.files)

    @property
    def rewritten(self) -> int:
        return sum(f.rewritten for f in self.files)


# ---------------------------------------------------------------------------------------------
# Graph level


def _ensure_opset(model: onnx.ModelProto) -> bool:
    if any(op.domain == DOMAIN for op in model.opset_import):
        return False
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return True


def rewrite_model(model: onnx.ModelProto, layout: int | str = SEQ_MAJOR) -> tuple[int, int, bool]:
    """Rewrites the GQA nodes of `model` in place to ai.kvlayout with `layout`.

    Returns (GQA nodes, nodes changed, whether the model changed at all: nodes or opset import).
    Raises UnsupportedNodeError, leaving `model` untouched, when any node cannot be patched.
    """
    layout = layout_id(layout)
    refusals = check_model(model)
    if refusals:
        raise UnsupportedNodeError(refusals)
    nodes = list(iter_gqa_nodes(model))
    changed = 0
    for node in nodes:
        has_attr = any(a.name == KV_LAYOUT_ATTR for a in node.attribute)
        if node.domain == DOMAIN and has_attr and node_kv_layout(node) == layout:
            continue
        kept = [a for a in node.attribute if a.name != KV_LAYOUT_ATTR]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(onnx.helper.make_attribute(KV_LAYOUT_ATTR, layout))
        node.domain = DOMAIN
        changed += 1
    opset_added = bool(nodes) and _ensure_opset(model)
    return len(nodes), changed, bool(changed) or opset_added


# ---------------------------------------------------------------------------------------------
# Directory level


def default_out_dir(model_dir: Path, layout: int) -> Path:
    suffix = "seq-major" if layout == SEQ_MAJOR else "head-major"
    return model_dir.parent / f"{model_dir.name}-{suffix}"


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
        return True
    except ValueError:
        return False


def _copy_file(src: Path, dst: Path, link: bool) -> None:
    """Copies one file (metadata too) without reading it into Python.

    link=True hard-links large files instead (instant, no disk space). ORT and onnxruntime-genai
    accept a hard-linked external-data file, but `onnx.load` refuses one with several links (a
    "hardlink attack" check) -- in the source directory too, while the link exists -- so copying
    is the default. Symbolic links are refused by both ORT and onnx and never used.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link and src.stat().st_size >= LINK_MIN_BYTES:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another filesystem, or links not allowed: copy
    try:
        _kernel_copy(src, dst)
        shutil.copystat(src, dst)
    except OSError as exc:  # a full disk says nothing of the file it was writing
        if not exc.filename:
            exc.filename = str(dst)
        raise


def _kernel_copy(src: Path, dst: Path) -> None:
    """copy_file_range: the kernel copies (or reflinks, on copy-on-write filesystems)."""
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None:
        shutil.copyfile(src, dst)
        return
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        remaining = os.fstat(fin.fileno()).st_size
        try:
            while remaining > 0:
                n = copy_range(fin.fileno(), fout.fileno(), min(remaining, 1 << 30))
                if n == 0:
                    break
                remaining -= n
        except OSError:  # not supported between these filesystems: plain copy of the rest
            shutil.copyfileobj(fin, fout, 16 << 20)
            return
        if remaining:
            shutil.copyfileobj(fin, fout, 16 << 20)


def _genai_sections(node: object, patched: set[str]) -> Iterator[dict]:
    """Dicts of genai_config's model section that name a patched ONNX file as `filename`."""
    if isinstance(node, dict):
        if isinstance(node.get("filename"), str) and node["filename"] in patched:
            yield node
        for value in node.values():
            yield from _genai_sections(value, patched)
    elif isinstance(node, list):
        for value in node:
            yield from _genai_sections(value, patched)


def update_genai_config(config: dict, patched: set[str], library: str) -> dict:
    """Names `library` (relative to the model folder) as custom_ops_library where it is needed.

    Always in model.decoder.session_options (onnxruntime-genai's default session options); also in
    every other section that names a patched file and has session_options of its own.
    """
    model = config.get("model")
    if not isinstance(model, dict):
        raise PatchError(f"{GENAI_CONFIG}: 'model' must be an object, got {json_type(model)}")
    if not isinstance(model.get("decoder"), dict):
        got = json_type(model["decoder"]) if "decoder" in model else "nothing (key missing)"
        raise PatchError(f"{GENAI_CONFIG}: 'model.decoder' must be an object, got {got}")
    targets = [model["decoder"]]
    targets += [
        s for s in _genai_sections(model, patched) if isinstance(s.get("session_options"), dict)
    ]
    for section in targets:
        options = section.setdefault("session_options", {})
        if not isinstance(options, dict):
            raise PatchError(
                f"{GENAI_CONFIG}: 'session_options' must be an object, got {json_type(options)}"
            )
        current = options.get("custom_ops_library")
        if current is not None and not isinstance(current, str):
            raise PatchError(
                f"{GENAI_CONFIG}: 'custom_ops_library' must be a string, got {json_type(current)}"
            )
        if current and Path(current).name != Path(library).name:
            raise PatchError(
                f"{GENAI_CONFIG} already names custom_ops_library={current!r}; onnxruntime-genai "
                f"loads one library per session, so {library!r} cannot be added"
            )
        options["custom_ops_library"] = library
    return config


def _resolve_library(library: str | os.PathLike | None | bool) -> Path | None:
    if library is None or library is False:
        return None
    if library is True or library == "auto":
        try:
            return Path(library_path())
        except (FileNotFoundError, OSError) as exc:
            raise PatchError(
                f"{exc}\n(pass library=PATH / --library PATH to use another build of it)"
            ) from exc
    path = Path(library)
    if path.is_dir():
        raise PatchError(f"custom-op library {path} is a directory, not the library's file")
    if not path.is_file():
        raise PatchError(f"custom-op library {path} not found")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise PatchError(f"custom-op library {path}: {exc.strerror or exc}") from exc
    if magic != b"\x7fELF":
        raise PatchError(f"custom-op library {path} is not a shared library (no ELF header)")
    return path


def _load_checked(path: Path) -> onnx.ModelProto:
    """The graph of one .onnx file, its external-data references checked (never read)."""
    try:
        model = load_model(path)
        check_external_data(model, path)
    except GraphError as exc:
        raise PatchError(str(exc)) from exc
    return model


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, deepest first (created, then removed on
    failure: a failed run leaves no directory it made)."""
    missing = []
    for parent in path.parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def patch_model_dir(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    layout: int | str = SEQ_MAJOR,
    force: bool = False,
    library: str | os.PathLike | None | bool = "auto",
    metadata: bool = True,
    link: bool = False,
    log: Callable[[str], None] | None = None,
    kv_quant: str | None = None,
) -> PatchResult:
    """Writes a patched copy of `model_dir` to `out_dir` (see the module docstring).

    library: "auto" copies ort_kvlayout.library_path(); a path copies that file; None copies none
    and leaves genai_config.json's session options as they are. metadata=False skips
    inference_metadata.yaml. link=True hard-links large files instead of copying them (see
    _copy_file for the caveat). kv_quant: a KV_QUANT_SCHEMES value ("int8-per-token", ...)
    converts the plain KV caches to PER_TOKEN (tools/kvquant.py) and records the scale caches'
    names in genai_config.json.

    Everything is read and checked before anything is written (graphs, external-data
    references, genai_config.json, the metadata); on any failure or interrupt, the temporary
    directory and the parent directories this call created are removed.
    """
    log = log or (lambda _msg: None)
    layout = layout_id(layout)
    if str(model_dir) == "" or (out_dir is not None and str(out_dir) == ""):
        raise PatchError("an empty path is not a directory (MODEL_DIR and -o must be named)")
    src = Path(model_dir).resolve()
    if not src.is_dir():
        raise PatchError(f"model directory {src} not found")
    given = Path(out_dir) if out_dir is not None else default_out_dir(src, layout)
    if given.is_symlink() and not given.exists():
        raise PatchError(f"output {given} is a dangling symbolic link; name a directory")
    dst = given.resolve()
    if dst == src or _is_within(dst, src) or _is_within(src, dst):
        raise PatchError(
            f"output {dst} must not be, contain or lie inside the model directory {src}"
        )
    if dst.exists() and not force:
        raise PatchError(f"output {dst} exists; pass --force to replace it")
    if dst.exists() and not dst.is_dir():
        raise PatchError(f"output {dst} exists and is not a directory")
    if dst.exists():  # --force replaces it: only a model folder, never the working directory
        if not (dst / GENAI_CONFIG).is_file():
            raise PatchError(
                f"output {dst} exists and holds no {GENAI_CONFIG}: --force replaces only a "
                "model folder (an earlier output); name a new directory"
            )
        if _is_within(Path.cwd().resolve(), dst):  # dst itself included
            raise PatchError(
                f"output {dst} contains the working directory; --force would remove it"
            )
    lib = _resolve_library(library)
    quant = _kv_quant_plan(src, kv_quant) if kv_quant is not None else None

    # Read and rewrite every graph first: refusals are raised before anything is written.
    onnx_files = sorted(p for p in src.rglob("*.onnx") if p.is_file())
    models: dict[Path, onnx.ModelProto] = {}
    rewritten: dict[str, bytes] = {}
    result = PatchResult(model_dir=src, out_dir=dst, layout=layout)
    refusals: list[tuple[str, str]] = []
    for path in onnx_files:
        rel = path.relative_to(src).as_posix()
        model = _load_checked(path)
        report = FileReport(rel)
        if quant is not None:
            prefix = f"{rel}: " if len(onnx_files) > 1 else ""
            quant_refusals = quant.convert(model, prefix)
            if quant_refusals:
                refusals += quant_refusals
                continue
        try:
            report.gqa_nodes, report.rewritten, file_changed = rewrite_model(model, layout)
        except UnsupportedNodeError as exc:
            prefix = f"{rel}: " if len(onnx_files) > 1 else ""
            refusals += [(prefix + name, reason) for name, reason in exc.refusals]
            continue
        models[path.resolve()] = model
        if file_changed:
            rewritten[rel] = model.SerializeToString()
        result.files.append(report)
        log(f"{rel}: {report.gqa_nodes} GroupQueryAttention node(s), {report.rewritten} rewritten")
    if refusals:
        raise UnsupportedNodeError(refusals)
    if result.gqa_nodes == 0:
        raise PatchError(f"no GroupQueryAttention node in {src} ({len(onnx_files)} .onnx file(s))")

    # genai_config.json and the metadata, from the rewritten graphs, still before any write.
    config = None
    if (src / GENAI_CONFIG).is_file():
        try:
            config = load_genai_config(src)
        except MetadataError as exc:
            if lib is not None:
                raise PatchError(str(exc)) from exc
    new_config_text = None
    if config is not None and (lib is not None or quant is not None):
        new_config = json.loads(json.dumps(config))
        if lib is not None:
            patched_files = {f.path for f in result.files if f.gqa_nodes}
            new_config = update_genai_config(new_config, patched_files, LIBRARY_NAME)
        if quant is not None:
            quant.record(new_config)
        if new_config != config:
            new_config_text = json.dumps(new_config, indent=4) + "\n"
    metadata_data = None
    if metadata:

        def read(path: Path):
            model = models.get(path.resolve())
            return graph_facts(model) if model is not None else graph_facts(_load_checked(path))

        try:
            metadata_data = build_metadata(src, read=read)
        except MetadataError as exc:
            raise PatchError(f"{exc} (pass --no-metadata to patch without it)") from exc

    created = _missing_parents(dst)
    first = created[-1].parent if created else dst.parent  # the deepest existing ancestor
    if not first.is_dir():
        raise PatchError(f"output {dst}: {first} is not a directory")
    tmp: Path | None = None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        # a short prefix: the output's name may be as long as a name can be
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name[:32]}.", suffix=".partial", dir=dst.parent))
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700: an ordinary directory
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            target = tmp / rel
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif rel in rewritten:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(rewritten[rel])
            elif path.is_file():
                _copy_file(path, target, link)
        if lib is not None:
            (tmp / LIBRARY_NAME).unlink(missing_ok=True)  # may be a link into the source
            shutil.copy2(lib, tmp / LIBRARY_NAME)
            result.library = LIBRARY_NAME
        if new_config_text is not None:
            (tmp / GENAI_CONFIG).unlink()  # never write through a link into the source
            (tmp / GENAI_CONFIG).write_text(new_config_text)
        # the source's file describes the source model: replaced, or dropped (--no-metadata)
        (tmp / METADATA_FILE).unlink(missing_ok=True)  # may be a link into the source
        if metadata_data is not None:
            write_metadata(metadata_data, tmp / METADATA_FILE, force=True)
            result.metadata = dst / METADATA_FILE
        _commit(tmp, dst, force)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            # the output's name for a file of the temporary directory (which is gone)
            name = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
            if name and Path(name).is_relative_to(tmp):
                exc.filename = str(dst / Path(name).relative_to(tmp))  # type: ignore[union-attr]
        for parent in created:  # deepest first; only if still empty
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    log(f"wrote {dst} ({result.rewritten} node(s) rewritten, kv_layout={LAYOUT_NAMES[layout]})")
    return result


@dataclass
class _KvQuantPlan:
    """--kv-quant: the scheme and the scale caches' names (from genai_config.json), applied to
    each graph before its layout rewrite."""

    scheme: str
    templates: dict[str, str]
    names: dict[str, str]

    def convert(self, model: onnx.ModelProto, prefix: str) -> list[tuple[str, str]]:
        return convert_model(model, self.scheme, self.names, prefix)

    def record(self, config: dict) -> None:
        """The scale caches' name templates under model.decoder.inputs / outputs."""
        decoder = config["model"]["decoder"]
        for key, template in self.templates.items():
            decoder["inputs" if key.startswith("past") else "outputs"][key] = template


def _kv_quant_plan(src: Path, scheme: str) -> _KvQuantPlan:
    try:
        check_scheme(scheme)
        config = load_genai_config(src)
        layers = config_int(config, "model.decoder.num_hidden_layers", 1, 1 << 16)
        decoder = config["model"]["decoder"]
        templates = {
            key: decoder["inputs" if key.startswith("past") else "outputs"].get(key, default)
            for key, default in SCALE_KEYS.items()
        }
        names = scale_names_for(decoder, layers, templates)
    except (KvQuantError, MetadataError) as exc:
        raise PatchError(f"--kv-quant: {exc}") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise PatchError(
            f"--kv-quant: {GENAI_CONFIG} lacks the decoder's past/present key/value name "
            f"templates ({type(exc).__name__}: {exc})"
        ) from exc
    return _KvQuantPlan(scheme, templates, names)


def _commit(tmp: Path, dst: Path, force: bool) -> None:
    """Renames the finished temporary directory to `dst` (replacing it under --force)."""
    if not dst.exists():
        os.rename(tmp, dst)
        return
    if not force:
        raise PatchError(f"output {dst} exists; pass --force to replace it")
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name[:32]}.", suffix=".old", dir=dst.parent))
    os.rename(dst, old / "x")
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old / "x", dst)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
