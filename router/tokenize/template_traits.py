"""What a chat template's source says about how the engine feeds it (read once, at load).

Engines look at the template before rendering: whether it loops over a message's content
(then they pass content as a list of parts, else as one string), whether it names the
`developer` role, and which variables it reads (vLLM passes a request's chat_template_kwargs
only when the template, or apply_chat_template itself, takes them). These are properties of
the parsed template (its jinja2 AST), computed here with each engine's own method:

- vLLM follows assignments: `{% set msgs = messages %}`, then `{% for m in msgs %}`, then
  `{% for part in m['content'] %}` (through filters, tests and slices) counts.
- SGLang takes any template that mentions image/audio/video/vision as taking parts, and
  otherwise only loops over `message.content`, `msg.content` or `m.content`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from router.tokenize.chat_rules import TemplateTraits


def inspect_template(source: str, apply_params: frozenset[str]) -> TemplateTraits:
    """The traits of a template; `apply_params` are apply_chat_template's own parameter names."""
    ast = _parse(source)
    meta = _jinja2_meta()
    variables = frozenset(meta.find_undeclared_variables(ast))
    return TemplateTraits(
        names_developer="developer" in source,
        content_as_parts=_vllm_loops_over_content(ast),
        content_as_parts_sglang=_sglang_loops_over_content(source, ast),
        accepted_kwargs=(variables | apply_params) - {"chat_template", "tokenize"},
    )


def _parse(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        # transformers' {% generation %}...{% endgeneration %} marks assistant text; parsing
        # only needs to know the tag exists.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    return env.parse(source)


def _jinja2_meta() -> Any:
    import jinja2.meta

    return jinja2.meta


def _nodes() -> Any:
    import jinja2.nodes

    return jinja2.nodes


# --- vLLM's detection -----------------------------------------------------------------------


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """`name` (or `name[key]` / `name.key`), possibly under filters, tests or a slice."""
    n = _nodes()
    if isinstance(node, n.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, n.Test):
        return _reads(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, n.Getitem):
        return _reads(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _reads(node.node, name) and node.attr == key
    return False


def _aliases(ast: Any, name: str) -> list[str]:
    """`name` and every variable assigned from it (transitively)."""
    n = _nodes()
    found = [name]
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for assign in ast.find_all(n.Assign):
            if isinstance(assign.target, n.Name) and _reads(assign.node, current):
                found.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    return found


def _loop_targets(ast: Any, over: list[str], key: str | None) -> Iterator[str]:
    n = _nodes()
    for loop in ast.find_all(n.For):
        if isinstance(loop.target, n.Name) and any(_reads(loop.iter, v, key) for v in over):
            yield loop.target.name


def _vllm_loops_over_content(ast: Any) -> bool:
    message_vars = list(_loop_targets(ast, _aliases(ast, "messages"), None))
    return next(_loop_targets(ast, message_vars, "content"), None) is not None


# --- SGLang's detection ---------------------------------------------------------------------


def _sglang_loops_over_content(source: str, ast: Any) -> bool:
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return True
    n = _nodes()
    return any(
        _reads(loop.iter, name, "content")
        for loop in ast.find_all(n.For)
        for name in ("message", "msg", "m")
    )
