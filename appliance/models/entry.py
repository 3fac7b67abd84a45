"""A new model's entry in ``appliance.yaml``: its name, how its path is written, and the file's text with it added.

The text is edited as a comment-keeping round trip (:mod:`appliance.config.roundtrip`, as ``appliance benchmark
--apply`` edits it): the entry goes at the end of ``models:`` (the list is made when the file has none), every other
line, comment and blank line stays, and the result must be a valid config.

Pure: text in, text out; every refusal is an :class:`~appliance.errors.ApplianceError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from appliance.config import roundtrip, schema
from appliance.config.types import Config
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.errors import ApplianceError

__all__ = ["added_text", "model_name_for", "name_owner", "raw_model_dirs", "written_path"]

_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.:-]+")
MAX_NAME_CHARS = 64


def model_name_for(filename: str) -> str:
    """The name a model file is added under when none is given: its file name without ``.gguf``, each run of
    characters a name may not hold replaced by ``-``, at most 64 characters (``Qwen2.5 0.5B.gguf`` ->
    ``Qwen2.5-0.5B``). BAD_REQUEST when nothing usable is left (then ``--name`` is needed)."""
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    name = _NOT_IN_NAME.sub("-", stem).strip("-._:")[:MAX_NAME_CHARS].rstrip("-._:")
    if not schema.MODEL_NAME.fullmatch(name):
        raise ApplianceError("BAD_REQUEST", f"cannot make a model name of the file name {filename!r}: give --name",
                             {"file": filename, "rule": "1-64 of letters, digits, '_', '.', ':', '-'"})
    return name


def name_owner(config: Config, name: str) -> ApplianceError | None:
    """``MODEL_EXISTS`` when ``name`` is already a configured model's name or alias (every name finds one model)."""
    for index, model in enumerate(config.models):
        if model.name == name:
            return ApplianceError("MODEL_EXISTS", f"a model named {name!r} is already configured (models[{index}]); "
                                  f"give another --name", {"name": name, "model": model.name, "as": "name"})
        if name in model.aliases:
            return ApplianceError("MODEL_EXISTS", f"{name!r} is already an alias of model {model.name!r} "
                                  f"(models[{index}].aliases); give another --name",
                                  {"name": name, "model": model.name, "as": "alias"})
    return None


def raw_model_dirs(text: str, file: str) -> list[str]:
    """``model_dirs`` as the file writes it (``{data_dir}/models`` unresolved), its default when the file has none."""
    _, root = _load(text, file)
    written = None if root is None else root.get("model_dirs")
    if written is None:
        return [str(folder) for folder in schema.BY_KEY["model_dirs"].default]
    if not isinstance(written, CommentedSeq) or not all(isinstance(folder, str) for folder in written):
        raise ApplianceError("CONFIG_INVALID", f"{file}: model_dirs is not a list of folders", {"file": file})
    return [str(folder) for folder in written]


def written_path(raw_dirs: Sequence[str], dirs: Sequence[Path], placed: Path) -> str:
    """How the entry writes ``placed`` (a file inside one of ``dirs``, the resolved ``model_dirs``): its folder as the
    file writes it (``raw_dirs``, same order), then its path inside, so that ``{data_dir}/…`` follows ``--data-dir``."""
    for raw, folder in zip(raw_dirs, dirs, strict=True):
        if placed.is_relative_to(folder):
            inside = PurePosixPath(*placed.relative_to(folder).parts)
            return f"{raw.rstrip('/')}/{inside}"
    raise ApplianceError("FORBIDDEN", f"{placed} is not inside a model_dirs folder",
                         {"path": str(placed), "model_dirs": [str(folder) for folder in dirs]})


def added_text(text: str, entry: Mapping[str, Any], *, source: Path | None = None) -> str:
    """``text`` (an ``appliance.yaml``) with ``entry`` (``{"name": …, "path": …, …}``) added at the end of its
    ``models:`` list, nothing else changed. ``CONFIG_INVALID`` when the file cannot be edited in place or the result
    would not be a valid config (naming the problem)."""
    file = "the config" if source is None else str(source)
    final_newline = text.endswith("\n") or not text
    body = text if final_newline else text + "\n"
    yaml, root = _load(body, file)
    item = CommentedMap()
    for key, value in entry.items():
        item[key] = DoubleQuotedScalarString(value) if isinstance(value, str) and value.startswith("{") else value
    allowed: set[int] = set()
    if root is None:  # nothing but comments: the list goes below them
        root = CommentedMap()
        root["models"] = _block([item])
        new_body = body + roundtrip.dump(yaml, root)
    else:
        models = root.get("models")
        if "models" not in root:
            roundtrip.append(root, "models", _block([item]), separate=len(root) > 0)
        elif models is None or (isinstance(models, CommentedSeq) and not models):  # `models:` or `models: []`
            position = roundtrip.key_position(root, "models")
            if position is not None:
                allowed.add(position[0])
            root["models"] = _block([item])
        elif isinstance(models, CommentedSeq) and not models.fa.flow_style():
            roundtrip.append_item(models, item, separate=roundtrip.separated(models, body))
        else:
            raise ApplianceError("CONFIG_INVALID", f"{file}: models is not a block list the editor can add to; add "
                                 f"the model by hand", {"file": file})
        new_body = roundtrip.dump(yaml, root)
    try:
        roundtrip.check_confined(body, new_body, allowed, True, file)
        roundtrip.check_comments_kept(body, new_body, file)
    except roundtrip.EditRejected as exc:
        raise ApplianceError("CONFIG_INVALID", exc.message, {"file": file}) from None
    new_text = new_body if final_newline else new_body.removesuffix("\n")
    try:
        parse_config(new_text, source=source)
    except ConfigInvalid as exc:
        raise ApplianceError("CONFIG_INVALID", f"adding the model would make {file} invalid: {exc.problems[0]}",
                             {"file": file, "problems": [problem.to_dict() for problem in exc.problems]}) from None
    return new_text


def _load(text: str, file: str) -> tuple[Any, Any]:
    try:
        return roundtrip.round_trip(text, file)
    except roundtrip.EditRejected as exc:
        raise ApplianceError("CONFIG_INVALID", exc.message, {"file": file}) from None


def _block(items: list[CommentedMap]) -> CommentedSeq:
    sequence = CommentedSeq(items)
    sequence.fa.set_block_style()
    return sequence
