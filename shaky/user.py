"""Your own model and data: factories named by import path or file, and objects handed over from Python.

``model.name`` and ``data.dataset`` take, besides the built-in names, a factory:

* ``package.module:factory``, imported as Python imports it;
* ``path/to/file.py:factory``, the file loaded as a module of its own (recorded by its absolute path).

A model factory is called as ``factory(input_shape, num_classes)`` under the run's seed (torch's global
generator, forked, so the caller's random state is untouched) and returns an ``nn.Module`` whose output is
the logits: ``[B, num_classes]``, or ``[B, T, V]`` for targets ``[B, T]`` (next-token prediction). A data
factory is called with no arguments, under the run's seed too, and returns ``(train, test)``, each a pair of
tensors ``(x, y)`` or a torch ``Dataset`` of such pairs. The SHA-256 of the factory's file is recorded in
config.toml (``model.sha256``, ``data.sha256``): a resume or a sweep whose file changed since stops, since
the run would no longer be the one it continues.

A model handed to :func:`shaky.simulate` as an object is named ``object:<module>.<class>`` and recorded by
the digest of its class's source and its parameters (:func:`object_digest`).

Whatever the source, the simulator trains every worker's model as a pure function of its parameters
(``torch.func.vmap`` over the ``[W, D]`` rows, ``shaky.vectorized``): :func:`check_model` refuses a model with
buffers (BatchNorm's running statistics are updated in place) or one vmap cannot run (data-dependent control
flow, dropout's randomness), before anything is written.

No torch at import: the config (which the command line reads before torch loads) checks names and digests.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

OBJECT_PREFIX = "object:"
"""The name of a model or data set given to :func:`shaky.simulate` as a Python object, not by a factory."""
_ATTR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_MODULE = _ATTR
_LOADED: dict[tuple[str, str], Any] = {}
"""Files loaded as modules in this process, by (absolute path, sha256): a sweep's setups load each once."""


def is_factory(name: str) -> bool:
    """Whether a model or data set name is a factory or an object (``...:...``) rather than a built-in name."""
    return ":" in name


def is_object(name: str) -> bool:
    return name.startswith(OBJECT_PREFIX)


def _split(setting: str, name: str) -> tuple[str, str]:
    """``(module or file, factory)`` of ``name``, or a ValueError naming the setting."""
    where, _, attr = name.rpartition(":")
    if not where or not _ATTR.fullmatch(attr):
        raise ValueError(f"{setting} {name!r} is not 'package.module:factory' or 'path/to/file.py:factory' "
                         "(the factory a Python name)")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def resolve(setting: str, name: str) -> str:
    """``name`` checked, with a file's path made absolute (config.toml then finds it from any directory)."""
    if is_object(name):
        return name
    where, attr = _split(setting, name)
    if _is_file(where):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"{setting} {name!r}: {where!r} is not a file")
        return f"{path.resolve()}:{attr}"
    if not _MODULE.fullmatch(where):
        raise ValueError(f"{setting} {name!r}: {where!r} is not a module name (package.module) nor a .py file")
    return name


def source_file(setting: str, name: str) -> Path:
    """The file whose code ``name``'s factory is: the .py file named, or the module's source as Python finds it
    (its parent packages are imported to find it)."""
    where, _ = _split(setting, name)
    if _is_file(where):
        return Path(where)
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{setting} {name!r}: cannot find module {where!r} ({type(exc).__name__}: {exc})") from None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise ValueError(f"{setting} {name!r}: no module {where!r} with a source file on the Python path")
    return Path(spec.origin)


def file_digest(setting: str, name: str) -> str:
    """SHA-256 of the file ``name``'s factory is defined in, recorded in config.toml (``*.sha256``)."""
    path = source_file(setting, name)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ValueError(f"{setting} {name!r}: cannot read {str(path)!r} ({exc.strerror or exc})") from None


def check_digest(setting: str, name: str, recorded: str, field: str | None = None) -> str:
    """The file's digest, which must be ``recorded`` (the setting ``field``, by default the section's ``sha256``)
    where that is set (a resume, a sweep's run, a copied config): a ValueError in one line where the file
    changed."""
    digest = file_digest(setting, name)
    field = field or setting.rsplit(".", 1)[0] + ".sha256"
    if recorded and recorded != digest:
        raise ValueError(f"{field} is {recorded[:16]}... but {str(source_file(setting, name))!r} now has sha256 "
                         f"{digest[:16]}...: the file changed since the run was configured, and a resume or a sweep "
                         f"goes on only with the code it started with (to train the edited file, start a new run "
                         f"without {field})")
    return digest


def load_factory(setting: str, name: str) -> Callable[..., Any]:
    """The callable ``name`` names: the module imported (or the file loaded as a module of its own)."""
    where, attr = _split(setting, name)
    try:
        if _is_file(where):
            module = _load_file(setting, name, Path(where))
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's module may raise anything, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ValueError(f"{setting} {name!r}: loading {where!r} failed ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]})") from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{setting} {name!r}: {where!r} has no {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{setting} {name!r}: {attr!r} is a {type(found).__name__}, not a function or class")
    return found


def _load_file(setting: str, name: str, path: Path) -> Any:
    digest = file_digest(setting, name)
    key = (str(path), digest)
    if key not in _LOADED:
        module_name = f"shaky_user_{digest[:16]}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{setting} {name!r}: {str(path)!r} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module     # dataclasses and pickling look their module up there
        # Its own imports of modules beside it (``from mynets import Net``) find them, as when Python runs the
        # file; last on the path, so that nothing there hides a module of the same name (the digest is the
        # file's alone: a change beside it goes unseen, as a change in an imported package does).
        if str(path.resolve().parent) not in sys.path:
            sys.path.append(str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        _LOADED[key] = module
    return _LOADED[key]


def call(setting: str, name: str, seed: int, *args: Any) -> Any:
    """``factory(*args)`` under the run's seed; whatever it raises is a ValueError naming the setting."""
    import torch  # noqa: PLC0415

    if is_object(name):
        raise ValueError(f"{setting} {name!r} was given to shaky.simulate as a Python object, which only that call "
                         "can give again (shaky.simulate(model, train, test, out=DIR, resume=True))")
    factory = load_factory(setting, name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return factory(*args)
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise ValueError(f"{setting} {name!r}: the factory raised {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:160]}") from None


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int) -> Any:
    """The model a factory makes, ``factory(input_shape, num_classes)`` under ``seed``."""
    from torch import nn  # noqa: PLC0415

    model = call("model.name", name, seed, tuple(input_shape), num_classes)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.name {name!r}: the factory returned a {type(model).__name__}, not a torch "
                         "nn.Module")
    return model


def object_name(obj: Any) -> str:
    """``object:<module>.<class>``: how config.toml names a model or data set given as a Python object."""
    cls = type(obj)
    return f"{OBJECT_PREFIX}{cls.__module__}.{cls.__qualname__}"


def function_name(fn: Any) -> str:
    """``object:<module>.<name>``: how config.toml names a loss given to ``shaky.simulate`` (a function, or a
    callable object such as ``nn.CrossEntropyLoss(reduction="none")``: its class)."""
    if inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn):
        return f"{OBJECT_PREFIX}{fn.__module__}.{fn.__qualname__}"
    return object_name(fn)


def function_digest(fn: Any) -> str:
    """SHA-256 of a loss given as a Python object: its name and source (where Python cannot find the source, its
    compiled code), and for a callable object its class's source, parameters and ``repr`` (its settings)."""
    h = hashlib.sha256(function_name(fn).encode())
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else None
    if target is None:
        h.update(object_digest(fn).encode())
        h.update(repr(fn).encode())
        return h.hexdigest()
    try:
        h.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        h.update(code.co_code if code is not None else repr(target).encode())
    return h.hexdigest()


def load_loss(name: str) -> Callable[..., Any]:
    """The loss ``model.loss`` names (a function in a module or file); one line where it is an object only
    ``shaky.simulate`` can give again."""
    if is_object(name):
        raise ValueError(f"model.loss {name!r} was given to shaky.simulate as a Python object, which only that call "
                         "can give again (shaky.simulate(model, train, test, loss=..., out=DIR, resume=True))")
    return load_factory("model.loss", name)


def object_digest(model: Any) -> str:
    """SHA-256 of a model object: its class's source (where Python can find it) and its parameters' names,
    shapes, dtypes and values. A resume through :func:`shaky.simulate` must be given the same."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256(object_name(model).encode())
    for cls in type(model).__mro__:
        if cls.__module__.startswith("torch."):
            break
        try:
            h.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):   # defined where no source is kept (an interactive session)
            pass
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def split_pairs(setting: str, name: str, part: str, given: Any) -> tuple[Any, Any]:
    """``(x, y)`` tensors of one split: a pair of tensors, or a torch Dataset of ``(x, y)`` pairs (stacked)."""
    import torch  # noqa: PLC0415

    where = f"{setting} {name!r}: the {part} split"
    if isinstance(given, (tuple, list)) and len(given) == 2 and all(isinstance(t, torch.Tensor) for t in given):
        x, y = given
    elif isinstance(given, torch.utils.data.Dataset) and hasattr(given, "__len__"):
        n = len(given)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError(f"{where} is an empty Dataset")
        items = [given[i] for i in range(n)]
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise ValueError(f"{where} is a Dataset whose items are not (x, y) pairs")
        try:
            x = torch.stack([torch.as_tensor(it[0]) for it in items])
            y = torch.stack([torch.as_tensor(it[1]) for it in items])
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: its items cannot be stacked ({' '.join(str(exc).split())[:120]})") from None
    else:
        raise ValueError(f"{where} is a {type(given).__name__}; give a pair of tensors (x, y) or a torch Dataset "
                         "(with a length) of (x, y) pairs")
    if x.dim() < 1 or len(x) != len(y) or len(x) < 1:
        raise ValueError(f"{where} has x {list(x.shape)} and y {list(y.shape)}; they need the same number of "
                         "samples (at least one)")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"{where} has y of dtype {y.dtype}; the targets are class indices (an integer tensor)")
    if y.numel() and int(y.min()) < 0:
        raise ValueError(f"{where} has a negative class index ({int(y.min())})")
    return x, y.to(torch.int64)


def dataset_of(setting: str, name: str, train: Any, test: Any) -> Any:
    """A :class:`shaky.data.Dataset` from the user's train and test splits (see :func:`split_pairs`)."""
    from shaky.data import Dataset  # noqa: PLC0415

    x_tr, y_tr = split_pairs(setting, name, "train", train)
    x_te, y_te = split_pairs(setting, name, "test", test)
    if x_tr.shape[1:] != x_te.shape[1:] or y_tr.shape[1:] != y_te.shape[1:] or x_tr.dtype != x_te.dtype:
        raise ValueError(f"{setting} {name!r}: train and test samples differ: x {list(x_tr.shape[1:])} "
                         f"{x_tr.dtype} and {list(x_te.shape[1:])} {x_te.dtype}, y {list(y_tr.shape[1:])} and "
                         f"{list(y_te.shape[1:])}")
    if y_tr.dim() > 1 and y_tr.shape[1:] != x_tr.shape[1:2]:
        raise ValueError(f"{setting} {name!r}: targets of shape {list(y_tr.shape[1:])} per sample; a sample's "
                         "targets are one class index, or one per position of a sequence (x [N, T], y [N, T])")
    num_classes = int(max(y_tr.max(), y_te.max())) + 1
    return Dataset(name=name, x_train=x_tr.contiguous(), y_train=y_tr.contiguous(), x_test=x_te.contiguous(),
                   y_test=y_te.contiguous(), input_shape=tuple(x_tr.shape[1:]), num_classes=num_classes,
                   classes=tuple(str(i) for i in range(num_classes)))


def load_data(name: str, seed: int) -> Any:
    """The data set a factory makes, ``factory()`` under ``seed``: ``(train, test)``."""
    made = call("data.dataset", name, seed)
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError(f"data.dataset {name!r}: the factory returned a {type(made).__name__}, not (train, test)")
    return dataset_of("data.dataset", name, *made)


def _users(call: Callable[[], Any], says: str, after: str = "", *, limit: int = 160) -> Any:
    """``call()``, which runs the user's code: whatever it raises becomes one ValueError,
    ``says (Type: message)after``."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the user's model or loss (vmap's refusals are errors of many kinds)
        raise ValueError(f"{says} ({type(exc).__name__}: {' '.join(str(exc).split())[:limit]}){after}") from None


def check_model(name: str, model: Any, data: Any, grad_fn: Callable[..., Any],
                forward_fn: Callable[..., Any], flat: Any, loss: Callable[..., Any] | None = None,
                loss_name: str = "") -> None:
    """Refuses, in one line, a model the simulator cannot train as a pure function of its parameters: one with
    buffers (BatchNorm's running statistics, updated in place by every forward pass), one whose output is not
    logits for the data's targets, or one that vmap cannot run (control flow on the values of tensors,
    randomness such as dropout's): its gradient is tried on two workers and two samples. A ``loss`` of the
    user's must give each sample's loss, ``[B]``, and be vmap's to batch too."""
    import torch  # noqa: PLC0415

    instead = ("the simulator trains each worker's model as a pure function of its parameters, "
               "vectorized over the workers")
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ValueError(f"model.name {name!r} has buffers ({', '.join(buffers[:3])}{', ...' * (len(buffers) > 3)}),"
                         f" which its forward pass updates in place (BatchNorm's running statistics): {instead}; "
                         "use GroupNorm or LayerNorm (or BatchNorm with track_running_stats=False)")
    if flat.dim == 0:
        raise ValueError(f"model.name {name!r} has no parameters to train")
    n = min(2, len(data.y_train))
    x, y = data.x_train[:n], data.y_train[:n]
    row = flat.flatten(model)
    with torch.no_grad():
        out = _users(lambda: forward_fn(row, x),
                     f"model.name {name!r} fails on {n} samples of x {list(x.shape[1:])} {x.dtype}")
    want = f"[{n}, {', '.join(str(s) for s in y.shape[1:])}{', ' if y.dim() > 1 else ''}C]"
    if (not isinstance(out, torch.Tensor) or out.shape[:-1] != y.shape or out.shape[-1] < data.num_classes
            or not out.is_floating_point()):
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model.name {name!r} returns {got} for {n} samples; the targets need logits {want} "
                         f"with C >= {data.num_classes} (the data's classes)")
    if loss is not None:
        with torch.no_grad():
            values = _users(lambda: loss(out, y),
                            f"model.loss {loss_name!r} fails on the logits {list(out.shape)} of {n} samples")
        if not isinstance(values, torch.Tensor) or values.shape != (n,) or not values.is_floating_point():
            got = list(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"model.loss {loss_name!r} returns {got} for {n} samples; it must return each "
                             f"sample's loss, [{n}] (as F.cross_entropy(..., reduction='none'))")
    what = f"model.name {name!r}" + (f" with model.loss {loss_name!r}" if loss is not None else "")
    _users(lambda: grad_fn(row[None].repeat(2, 1), x[None].repeat(2, *[1] * x.dim()),
                           y[None].repeat(2, *[1] * y.dim()), torch.ones(2, n, dtype=row.dtype, device=row.device)),
           f"{what} cannot be vectorized over the workers by torch.func.vmap",
           f": {instead}; write its forward pass without control flow on tensor values, in-place updates or dropout",
           limit=200)
