"""What a command line may take from the user's own code, and the flags of run-folder scripts.

An object named ``package.module:name`` (a backbone,
a prior), imported with a one-line error, and keyword arguments given as text (``--prior-arg concentration=5``),
checked against the constructor they are for and converted to the types it declares; and the flags by which a script
that opens a run folder is told to import the code its configuration names (``evaluate.loading.load_learner``).
"""

import argparse
import ast
import importlib
import inspect

from bayesncl_pyro.errors import UserError, quoted

_TYPES = {t.__name__: t for t in (int, float, bool, str)}


class Registry(dict):
    """Name -> the class or builder of one kind that a command-line flag names.

    Kinds: priors, gate estimators, backbones. ``@registry.register("name")`` adds one (a class also gets ``name`` as
    its ``.name``). The public one is the priors' (``bayesncl_pyro.PRIORS``): ``--prior NAME`` picks ``PRIORS[NAME]``.

    Examples:
        >>> sorted(PRIORS)
        ['bernoulli', 'beta-bernoulli', 'ibp', 'learned', 'logit-normal', 'per-image']
        >>> PRIORS["beta-bernoulli"](16, prior_prob=0.8, concentration=10.0).mean_rate()[:2]
        tensor([0.8000, 0.8000])
    """

    def register(self, name: str):
        """Decorator that registers its class or builder under ``name``.

        Args:
            name: the name a command-line flag picks it by (for the priors, ``--prior name``).

        Returns:
            The decorator: it adds its argument to the registry under ``name`` and returns it (a class with its
            ``.name`` set to ``name``).

        Examples:
            >>> @register("decaying")  # the priors' register: --prior decaying now builds it
            ... class DecayingPrior(Prior):
            ...     def rate(self):
            ...         k = torch.arange(1, self.num_features + 1)
            ...         return self.prior_prob ** (k / self.num_features)
            >>> PRIORS["decaying"] is DecayingPrior, DecayingPrior.name
            (True, 'decaying')
            >>> BayesNCLHead(64, proj_dim=16, proj_hidden=32, num_train=100, prior="decaying").gated
            True
            >>> del PRIORS["decaying"]  # this example's own: the registry as it was
        """
        def add(obj):
            if isinstance(obj, type):
                obj.name = name
            self[name] = obj
            return obj

        return add


TIMM = "timm:"  # an encoder spec naming a timm model, "timm:<model name>": code, but not the run's own


def is_spec(name: str) -> bool:
    """Whether ``name`` is a ``package.module:name`` reference rather than a registry name."""
    return ":" in name


def import_spec(spec: str, flag: str):
    """The object that ``spec`` (``package.module:name``) names.

    ``flag`` (e.g. ``--prior``) heads the message
    of a spec that does not import.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"{flag} {spec!r} is not of the form package.module:name")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:  # the module, or something it imports, is missing
        raise UserError(f"{flag} {spec}: cannot import {module_name} ({e}); install it, or put the folder that "
                        "holds it on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{flag} {spec}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def typed_kwargs(fn, given: dict, fixed: dict[str, str], what: str, flag: str) -> dict:
    """``given`` checked against the keyword parameters of ``fn`` and converted to their types.

    ``given``: name -> value, as text or already typed; a type is the annotation's, or the default's.

    ``fixed``: parameters that other options set (name -> that option), refused here; ``what`` names ``fn`` and
    ``flag`` the option in the messages.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if n not in fixed
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    out = {}
    for name, value in given.items():
        if name in fixed:
            raise UserError(f"{flag} {name}: set it with {fixed[name]}")
        if name not in named and not takes_any:
            raise UserError(f"{flag} {name}: {what} takes no argument {name!r}; it takes "
                            f"{', '.join(named) or 'none'}")
        shown = value if isinstance(value, str) else quoted(value)  # text as --prior-arg gave it
        out[name] = _convert(value, named.get(name), f"{flag} {name}={shown}: {what}'s {name}")
    return out


def _convert(value, param: inspect.Parameter | None, context: str):
    """``value`` as the type ``param`` declares.

    The type is the annotation, else the default's type; text of an undeclared
    type is read as a Python literal, or kept as text.
    """
    kind = None
    if param is not None:
        annotation = param.annotation
        kind = _TYPES.get(annotation) if isinstance(annotation, str) else annotation
        if kind not in _TYPES.values():
            kind = type(param.default) if type(param.default) in _TYPES.values() else None
    if kind is None:
        if not isinstance(value, str):
            return value
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false", "1", "0"):
            return str(value).lower() in ("true", "1")
        raise UserError(f"{context} takes true or false")
    if isinstance(value, bool) and kind is not str:  # bool is an int subclass: True is no number here
        raise UserError(f"{context} takes a {kind.__name__}, not {quoted(value)}")
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        raise UserError(f"{context} takes a {kind.__name__}") from None
    if kind is int and converted != float(value):  # int("5.5") fails, but int(5.5) would truncate
        raise UserError(f"{context} takes an int")
    return converted


def add_reader_flags(p: argparse.ArgumentParser, data_dir: bool = True):
    """The flags of a script that opens a run folder.

    For ``evaluate.loading.load_learner``: --trust-run, and --data-dir if it
    reads the run's data.
    """
    if data_dir:
        p.add_argument("--data-dir", help="the run's data folder (default: the run's own, when it is an absolute "
                       "path outside the run folder)")
    p.add_argument("--trust-run", action="store_true", help="import the code that the run's configuration names "
                   "(an --encoder or --prior package.module:name); a run folder is refused otherwise, as it would run "
                   "its writer's code")
