"""The rule for a user's sbatch template: it extends ddpkit's, and keeps the stop-signal protocol.

ddpkit's base template (``templates/base.sh.j2``) holds the stop-signal protocol (the batch
shell's trap, the latch folder, the holder, the loop passing a held signal on); a template that
replaced the whole script would drop it silently, and SLURM's warning would kill the job
instead of stopping it with a checkpoint.

So, when the spec has a stop signal, a user's template must ``{% extends %}`` one of ddpkit's
(``launch_template`` or one named), contain nothing but blocks beside it (a top-level
``{% set signal = none %}`` would reach the base), and override only :data:`USER_BLOCKS`; else
a ConfigError, before anything is submitted. With ``signal: null`` any template is accepted.
"""

from __future__ import annotations

from collections.abc import Collection

import jinja2
from jinja2 import nodes

from ddpkit.errors import ConfigError
from ddpkit.jobs.spec_checks import shown

__all__ = ["LAUNCH_TEMPLATE_NAME", "USER_BLOCKS", "check_user_template"]

# The blocks of base.sh.j2 a user's template may override (its header documents them).
USER_BLOCKS = ("sbatch_extra", "before_launch", "srun_options", "task_command", "after_launch")
LAUNCH_TEMPLATE_NAME = "launch_template"  # the context variable naming the spec's mode


def check_user_template(
    env: jinja2.Environment, path: str, builtin: Collection[str], signal: str | None
) -> None:
    """Refuse the template at ``path`` when, with a stop ``signal``, it would drop ddpkit's
    stop-signal protocol (see the module docstring); ``builtin``: ddpkit's template names."""
    if signal is None:
        return
    source, _, _ = env.loader.get_source(env, path) if env.loader else ("", None, None)
    body = env.parse(source, path, path).body
    problem = _problem(body, builtin)
    if problem is not None:
        raise ConfigError(
            f"template={shown(path)} {problem}: it could drop ddpkit's stop-signal protocol "
            f"(signal: {signal})",
            hint=f"start it with {{% extends {LAUNCH_TEMPLATE_NAME} %}} and override only the "
            f"blocks {', '.join(USER_BLOCKS)} (see ddpkit/templates/base.sh.j2), "
            "or set signal: null",
        )


def _problem(body: list[nodes.Node], builtin: Collection[str]) -> str | None:
    """What in a template's top level drops the protocol, or None."""
    extends = [node for node in body if isinstance(node, nodes.Extends)]
    if len(extends) != 1 or not _names_ddpkits(extends[0].template, builtin):
        return "does not extend ddpkit's template"
    for node in body:
        if isinstance(node, nodes.Block) and node.name not in USER_BLOCKS:
            return f"overrides the block {node.name!r} (line {node.lineno}), which is ddpkit's own"
        if not isinstance(node, nodes.Extends | nodes.Block) and not _blank(node):
            return f"has a statement outside its blocks (line {node.lineno})"
    return None


def _names_ddpkits(template: nodes.Expr, builtin: Collection[str]) -> bool:
    if isinstance(template, nodes.Name):
        return template.name == LAUNCH_TEMPLATE_NAME
    return isinstance(template, nodes.Const) and template.value in builtin


def _blank(node: nodes.Node) -> bool:
    """Text between the top-level tags that renders as nothing but whitespace (Jinja ignores
    it after the extends; before it, a newline or two)."""
    if not isinstance(node, nodes.Output):
        return False
    return all(isinstance(n, nodes.TemplateData) and not n.data.strip() for n in node.nodes)
