"""verl's tools YAML (``multi_turn.tool_config_path``) and its ``BaseTool`` classes, unchanged.

The convention (verl's ``initialize_tools_from_config`` and ``ToolAgentLoop``): a YAML file
``tools: [{class_name: pkg.mod.Cls, config: {type: native, ...}, tool_schema: {type:
function, function: {name, description, parameters}}}]``; each class is built as
``Cls(config=config, tool_schema=schema)`` and offers ``async create(instance_id=None,
**kwargs)`` (an id, or ``(id, response)``), ``async execute(instance_id, parameters)``
(``(response, reward, metrics)``, the response a string or a ``ToolResponse`` with ``text``),
``async calc_reward`` and ``async release``. verl's agent loop runs each call as create ->
execute -> release, and shows the model only the response text; so do these tools (the
per-call reward and ``calc_reward`` are not used, as in verl's ``ToolAgentLoop``).

verl itself is not needed: a class that subclasses verl's ``BaseTool`` imports verl, and then
its ``OpenAIFunctionToolSchema`` is passed; otherwise a ``SchemaView`` (the same dict, read by
attribute too, with ``model_dump``). Only ``native`` tools are supported (no MCP). A bad file
or schema is a ValueError naming the entry, raised when the tools load (the worker's start).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from rlfleet.agent.adapters.text import call
from rlfleet.agent.tool_types import Tool
from rlfleet.agent.tools import ToolBox, load_object

SUFFIXES = (".yaml", ".yml")


class SchemaView(dict):
    """A tool schema dict that reads like verl's pydantic ``OpenAIFunctionToolSchema``."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc
        return SchemaView(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return json.loads(json.dumps(self))


def is_tool_config(spec: object) -> bool:
    """An ``agent.tools`` entry that names a verl tools YAML file."""
    return isinstance(spec, str) and spec.endswith(SUFFIXES)


def load_toolbox(specs: list[Any], **toolbox_kwargs: Any) -> ToolBox:
    """A ToolBox of ``agent.tools`` entries: typed functions (or their ``module:attr``) and
    verl tools YAML files, the YAML's tools added under their schema names."""
    box = ToolBox([spec for spec in specs if not is_tool_config(spec)], **toolbox_kwargs)
    for tool in (t for spec in specs if is_tool_config(spec) for t in load_tool_config(spec)):
        if tool.name in box.tools:
            raise ValueError(f"tool {tool.name!r} is named twice in agent.tools")
        if toolbox_kwargs.get("sandbox"):
            raise ValueError(f"verl tool {tool.name!r} cannot run sandboxed (async, stateful)")
        box.tools[tool.name] = tool
    return box


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of one verl tools YAML file."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    entries = config.get("tools") if isinstance(config, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a verl tools file holds a list under `tools:`")
    return [make_verl_tool(entry, f"{path}: tools[{i}]") for i, entry in enumerate(entries)]


def make_verl_tool(entry: object, where: str) -> Tool:
    """One entry as a Tool whose function runs create -> execute -> release."""
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: each tool needs a class_name (pkg.module.Class)")
    config = dict(entry.get("config") or {})
    if config.get("type", "native") != "native":
        raise ValueError(f"{where}: only native tools are supported, not {config['type']!r}")
    raw = entry.get("tool_schema")
    cls = _tool_class(entry["class_name"], where)
    try:
        instance = cls(config=config, tool_schema=None if raw is None else _schema_object(raw))
    except Exception as exc:  # noqa: BLE001 - user code; its failure names the entry
        raise ValueError(
            f"{where}: {cls.__name__}(...) raised {type(exc).__name__}: {exc}"
        ) from exc
    schema = checked_schema(_schema_dict(instance, raw), where)
    name = schema["function"]["name"]
    return Tool(name, _runner(instance, name), schema)


def checked_schema(schema: object, where: str) -> dict[str, Any]:
    """``schema`` if it is an OpenAI function schema (a name; parameters an object schema)."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if (
        not isinstance(schema, dict)
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise ValueError(
            f"{where}: tool_schema must be {{type: function, function: {{name, ...}}}}"
        )
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"{where}: tool_schema function.parameters must be an object schema")
    return schema


def response_text(value: object) -> str:
    """What the model reads of ``execute``'s answer: the response of ``(response, reward,
    metrics)`` (a bare response is taken too), as text."""
    response = value[0] if isinstance(value, tuple | list) and len(value) == 3 else value
    if isinstance(response, dict):
        response = response.get("text")
    else:
        response = getattr(response, "text", response)
    if response is not None and not isinstance(response, str):
        raise TypeError(
            f"execute must answer (text or ToolResponse, reward, metrics), got {value!r}"
        )
    return response or ""


def _runner(tool: Any, name: str) -> Any:
    async def run(**parameters: Any) -> str:
        created = await call(tool.create, create_kwargs={})
        instance_id = created[0] if isinstance(created, tuple | list) else created
        try:
            return response_text(await call(tool.execute, instance_id, parameters))
        finally:
            await call(tool.release, instance_id)

    run.__name__ = run.__qualname__ = name
    return run


def _tool_class(class_name: str, where: str) -> type:
    """verl's ``pkg.module.Class`` (a ``module:Class`` import path works too)."""
    try:
        if ":" in class_name:
            return load_object(class_name)
        module, _, attr = class_name.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot load {class_name!r}: {exc}") from exc


def _schema_object(raw: object) -> Any:
    """The schema as verl's classes expect it: verl's model when verl is there, else a view."""
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema
    except ImportError:
        return SchemaView(raw) if isinstance(raw, dict) else raw
    return OpenAIFunctionToolSchema.model_validate(raw)


def _schema_dict(instance: Any, raw: object) -> object:
    get = getattr(instance, "get_openai_tool_schema", None)
    schema = get() if callable(get) else getattr(instance, "tool_schema", raw)
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    return schema
