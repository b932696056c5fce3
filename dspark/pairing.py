"""Which target a drafter (or a ``dspark data build`` directory) was made for, and loading a target with its drafter.

Shared by the ``dspark`` command, the demo page and the benchmark scripts. Every refusal raises :class:`InputError`
with a message that names the option or path at fault (the command prints it as a usage error, exit code 2), before
a model loads where the files tell.
"""

from __future__ import annotations

from pathlib import Path

RANDOM_DRAFTER_SEED = 0
RANDOM_DRAFTER_BLOCK_SIZE = 8


class InputError(Exception):
    """A drafter, target or data directory that does not fit the job or does not load; the message is for the
    user."""


def target_for_drafter(target: str | None, drafter: str | None, flag: str = "--drafter",
                       shown: str | None = None) -> str | None:
    """``--target``, else the target that drafter directory ``drafter`` was trained for (its config's
    ``target_name_or_path``) when that is a packaged target or, by absolute path, a model directory here, else None
    (the default target): a drafter for Qwen2.5-Coder-0.5B-Instruct runs with that target without ``--target``.

    Args:
        flag: the option or argument that named ``drafter``, for the error message; ``shown``: the value to show
            (default ``drafter``).

    Raises:
        InputError: ``target`` is a packaged target and the drafter records another one (checked from the configs,
            before either model loads).
    """
    if drafter in (None, "random"):
        return target
    if target is None:
        return loadable_target_of(drafter, drafter=True)
    check_made_for_target(target, flag, drafter, drafter=True, shown=shown,
                          fix="leave out --target to use the drafter's own, or give a drafter made for this one")
    return target


def _recorded_target(path, drafter: bool) -> str | None:
    """The target that directory ``path`` records, as written: a ``dspark data build`` directory's (``manifest.json``,
    ``config.target``) or, with ``drafter``, a drafter's (``config.json``, ``target_name_or_path``, or a speculators
    export's ``speculators_config.verifier.name_or_path``); None when it records none or cannot be read."""
    from modeling_dspark.formats import read_json

    try:
        if drafter:
            config = read_json(Path(path) / "config.json")
            made = config.get("target_name_or_path") or (
                ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"))
        else:
            made = (read_json(Path(path) / "manifest.json").get("config") or {}).get("target")
    except (OSError, ValueError, AttributeError):
        return None
    return made if isinstance(made, str) and made else None


def local_target_of(path, drafter: bool = True) -> str | None:
    """The target recorded by directory ``path`` (a drafter's, or without ``drafter`` a data build's) when it is an
    absolute path to a model directory here (with a ``config.json``), else None: a relative path would depend on the
    working directory."""
    name = _recorded_target(path, drafter)
    ok = name is not None and Path(name).is_absolute() and (Path(name) / "config.json").is_file()
    return name if ok else None


def made_with_target(path, drafter: bool = False) -> str | None:
    """The packaged target that directory ``path`` was made with (:func:`_recorded_target`), recorded by name, by the
    path of its cached copy or by its Hub id (what an export writes); None when it records none (a ``save_to_disk``
    directory, another target, unreadable)."""
    from modeling_dspark.target import PACKAGED_TARGETS, packaged_target_name

    made = _recorded_target(path, drafter)
    if made is None:
        return None
    by_hub_id = {packaged.hub_id: name for name, packaged in PACKAGED_TARGETS.items()}
    return packaged_target_name(made) or by_hub_id.get(made)


def loadable_target_of(path, drafter: bool) -> str | None:
    """The target directory ``path`` records when this machine can load it: a packaged target
    (:func:`made_with_target`) or a model directory here named by absolute path (:func:`local_target_of`); else
    None."""
    return made_with_target(path, drafter) or local_target_of(path, drafter)


def target_of_data(target: str | None, data: list[str]) -> str | None:
    """``--target``, else the target the ``--data`` directories were built with: a packaged target or, by absolute
    path, a model directory here; None (the default target) when they record none. Data built with a local checkpoint
    trains a drafter for it without ``--target``.

    Raises:
        InputError: the directories record different targets, or one records a target that is neither a packaged
            target nor a model directory here (a relative path, a moved directory): ``--target`` must name it.
    """
    if target is not None:
        return target
    found = set()
    for d in data:
        made = loadable_target_of(d, drafter=False)
        if made is None and (recorded := _recorded_target(d, drafter=False)) is not None:
            raise InputError(f"--data {d} was built with target {recorded!r}, which is not a packaged target or a "
                             "model directory here: pass --target")
        found |= {made} - {None}
    if len(found) > 1:
        raise InputError(f"the --data directories were built with different targets ({', '.join(sorted(found))}): "
                         "train on one target's data")
    return found.pop() if found else None


def check_made_for_target(target: str | None, flag: str, path, *, drafter: bool = False, shown: str | None = None,
                          fix: str | None = None) -> None:
    """Refuse data (or, with ``drafter``, a drafter) at ``path`` made with another packaged target than ``target``
    (None: the default target), before anything loads: its token ids and features belong to that target.

    Args:
        flag: the option that named ``path``, for the message; ``shown``: the value to show (default ``path``).
        fix: what the message advises (default: pass ``--target`` with the target ``path`` was made with).

    Raises:
        InputError: naming the flag, the directory and the target it was made with.
    """
    from modeling_dspark.target import DEFAULT_TARGET, packaged_target_name

    want = packaged_target_name(target or DEFAULT_TARGET)
    other = made_with_target(path, drafter)
    if other is not None and want is not None and other != want:
        raise InputError(f"{flag} {shown or path} was made with target {other}, not {target or DEFAULT_TARGET}: "
                         f"{fix or f'pass --target {other}'}")


def drafter_dir(spec: str, hub: bool = True, weights: bool = True) -> str:
    """The local directory of drafter ``spec``, checked to hold a readable ``config.json`` and (with ``weights``)
    safetensors weights, so that a wrong drafter is reported before the target loads.

    Args:
        spec: a drafter directory (``~`` expanded), or (with ``hub``) a Hub repository id, fetched or read from the
            local Hugging Face cache by :func:`modeling_dspark.hub.resolve_pretrained_dir`.
        hub: accept Hub ids; False where the command writes into the drafter directory.
        weights: require ``*.safetensors`` files; False where only the config is read.

    Raises:
        InputError: no such directory or repository, no ``config.json``, one that is not a JSON object, no
            safetensors weights, or a weights file whose header or size is not that of a safetensors file
            (truncated or not safetensors at all).
    """
    from modeling_dspark.formats import read_json
    from modeling_dspark.hub import resolve_pretrained_dir

    if hub:
        try:
            path = resolve_pretrained_dir(spec)
        except OSError as err:
            raise InputError(str(err)) from None
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise InputError(f"drafter directory not found: {spec!r}")
    if not (path / "config.json").is_file():
        raise InputError(f"drafter {spec!r} is not a drafter directory (no config.json)")
    try:
        read_json(path / "config.json")
    except OSError as err:
        raise InputError(f"drafter {spec!r}: {err}") from None
    if weights:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"drafter {spec!r} has no *.safetensors weights file")
        for f in files:
            try:  # reads the header and checks the tensors' byte ranges against the file size; loads no tensor
                with safe_open(str(f), framework="pt"):
                    pass
            except Exception as err:  # safetensors raises its own SafetensorError (or OSError) for a bad file
                raise InputError(f"drafter {spec!r}: corrupt weights file {f.name} ({err})") from None
    return str(path)


def load_drafter(spec: str, target, dtype):
    """The drafter named by ``spec`` — ``"random"`` (untrained, fixed seed, block size 8) or a drafter directory —
    bound to ``target`` with ``target.generate(..., assistant_model=drafter)`` enabled.

    Raises:
        InputError: the directory does not hold a loadable drafter for this target.
    """
    import torch

    from modeling_dspark import DSparkConfig, DSparkDraftModel

    if spec == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_DRAFTER_SEED)
            drafter = DSparkDraftModel(
                DSparkConfig.from_target_config(target.config, block_size=RANDOM_DRAFTER_BLOCK_SIZE)
            )
        drafter = drafter.to(dtype=dtype, device=target.device).eval().bind_target(target)
        return drafter
    try:
        return DSparkDraftModel.from_pretrained(spec, target=target, dtype=dtype).eval()
    except (OSError, ValueError) as err:
        raise InputError(f"could not load drafter: {err}") from None


def load_models(target_path, drafter_spec: str | None, dtype_name: str, device: str = "cpu"):
    """Load ``(target, tokenizer, drafter | None)`` in dtype ``dtype_name`` on ``device``: the target as
    :func:`load_target_checked`, the drafter (None: none) as :func:`load_drafter`, bound to the target.

    Raises:
        InputError: a target or drafter that does not load, or a random drafter for a target family DSpark does not
            support.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    target, tok = load_target_checked(target_path, dtype=dtype, device=device)
    if drafter_spec is None:
        return target, tok, None
    try:
        return target, tok, load_drafter(drafter_spec, target, dtype)
    except ValueError as err:  # e.g. a target family DSpark does not support (random drafter)
        raise InputError(f"could not make a drafter for this target: {err}") from None


def load_target_checked(spec: str | None, **kwargs):
    """``modeling_dspark.target.load_target(spec, **kwargs)``.

    Raises:
        InputError: the directory does not hold a loadable transformers model and tokenizer.
    """
    from modeling_dspark.target import DEFAULT_TARGET, load_target

    try:
        return load_target(spec, **kwargs)
    except (OSError, ValueError) as err:
        raise InputError(f"could not load target {spec or DEFAULT_TARGET!r}: {err}") from None
