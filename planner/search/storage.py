"""Where a study lives: any SQLAlchemy URL Optuna's RDBStorage accepts (postgresql://...,
mysql+pymysql://..., sqlite:///PATH), shared by every worker that names it.

    storage = open_storage("postgresql://tuner:pw@db/optuna", heartbeat_s=30)
    claim_study(storage, "i23", key, "glm-10b on 8xA100")   # refuses a study of other inputs

Bad input is one line naming `--storage` or `--study` (planner.errors.SpecError): an unknown
scheme, a missing driver, a database that does not answer, a study created for another model
or cluster. The URL is printed with its password replaced by `***`; no SQLAlchemy traceback.
A plain `postgresql://` URL uses psycopg 3 (pinned in requirements.txt), SQLAlchemy 2.1's
default PostgreSQL driver.
"""
from __future__ import annotations

import time
from typing import Any

from planner.errors import SpecError

INPUTS_ATTR = "planner_inputs"
"""Study user attribute: {"key": hash of the inputs, "label": "<model> on <cluster>"}."""

_FIX = "give an Optuna storage URL, e.g. postgresql://USER:PASSWORD@HOST:5432/DB or sqlite:///study.db"


def safe_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***, for messages."""
    try:
        from sqlalchemy.engine import make_url
        u = make_url(url)
        return u.render_as_string(hide_password=True) if u.password else str(u)
    except Exception:  # not even a URL: show the scheme only
        return url.split("://", 1)[0] + "://..." if "://" in url else "(not a URL)"


def _reason(exc: BaseException, url: str) -> str:
    """One line of why a URL did not open, without the password."""
    from sqlalchemy import exc as sa_exc
    if isinstance(exc, sa_exc.NoSuchModuleError):
        return f"unknown database scheme {url.split('://', 1)[0]!r}"
    if isinstance(exc, sa_exc.ArgumentError):
        return "not a database URL"
    orig = getattr(exc, "orig", None) or exc
    lines = [ln.strip() for ln in str(orig).strip().splitlines() if ln.strip()]
    line = (lines[0] if lines else type(orig).__name__)[:200]
    try:
        from sqlalchemy.engine import make_url
        pw = make_url(url).password
    except Exception:
        pw = None
    return line.replace(pw, "***") if pw else line


def open_storage(url: str, *, heartbeat_s: float | None = None, max_retry: int = 3) -> Any:
    """An RDBStorage on `url`; with `heartbeat_s`, running trials beat every `heartbeat_s`
    seconds, a trial silent for 2 x heartbeat_s is marked failed by the next worker that looks,
    and RetryHeartbeatStaleTrialCallback (Optuna 5's name for RetryFailedTrialCallback) queues it
    again, at most `max_retry` times."""
    import warnings

    import optuna
    from sqlalchemy import exc as sa_exc
    if "://" not in url:
        raise SpecError("--storage", f"{safe_url(url)} is not a URL", _FIX)
    kw: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():     # heartbeats are "experimental" in Optuna since 2.8
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if heartbeat_s is not None:
                kw = {"heartbeat_interval": max(1, int(round(heartbeat_s))),
                      "grace_period": max(2, int(round(2 * heartbeat_s))),
                      "heartbeat_stale_trial_callback":
                          optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)}
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url), **kw)
            except sa_exc.DBAPIError as exc:
                if not _schema_race(exc):
                    raise
                time.sleep(1.0)              # another worker created the schema at the same moment
                return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url), **kw)
    except Exception as exc:  # SQLAlchemy / driver errors: one line, no traceback, no password
        raise SpecError("--storage", f"cannot open {safe_url(url)}: {_reason(exc, url)}", _FIX) from None


def _schema_race(exc: BaseException) -> bool:
    """Two workers creating Optuna's tables at once: a duplicate table, type or version row."""
    from sqlalchemy import exc as sa_exc
    text = str(getattr(exc, "orig", exc)).lower()
    return isinstance(exc, sa_exc.IntegrityError) or "already exists" in text or "duplicate" in text


def _engine_kwargs(url: str) -> dict[str, Any]:
    """A database that does not answer fails in seconds, not after the driver's default."""
    scheme = url.split("://", 1)[0]
    if scheme.startswith(("postgresql", "postgres")):
        return {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    if scheme.startswith("mysql"):
        return {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    return {}


def _study_id(storage: Any, name: str) -> int | None:
    import optuna
    try:
        return storage.get_study_id_from_name(name)
    except KeyError:
        return None
    except optuna.exceptions.OptunaError:
        return None


def check_study(storage: Any, name: str, key: str, label: str, where: str = "") -> bool:
    """Refuse (SpecError, nothing written) a study `name` made for other inputs; True if it exists."""
    sid = _study_id(storage, name)
    if sid is None:
        return False
    attrs = storage.get_study_user_attrs(sid).get(INPUTS_ATTR)
    theirs = attrs.get("label", "other inputs") if isinstance(attrs, dict) else None
    if isinstance(attrs, dict) and attrs.get("key") == key:
        return True
    if attrs is None and not storage.get_all_trials(sid, deepcopy=False):
        return True                     # an empty study someone created by hand: adopt it
    what = f"was created for {theirs}" if theirs else "was not created by `planner search`"
    raise SpecError("--study", f"study {name!r}{where} {what}; this search is for {label}",
                    "give another --study name, or the model, cluster and training flags the study was made with")


def claim_study(storage: Any, name: str, key: str, label: str, *, direction: str = "maximize",
                sampler: Any = None, url: str = "") -> Any:
    """Create or load study `name`, recording the inputs it is for; refuse one made for others."""
    import optuna
    where = f" in {safe_url(url)}" if url else ""
    existed = check_study(storage, name, key, label, where)
    study = optuna.create_study(storage=storage, study_name=name, sampler=sampler, direction=direction,
                                load_if_exists=True)
    if not existed:
        check_study(storage, name, key, label, where)   # another worker may have created it meanwhile
        study.set_user_attr(INPUTS_ATTR, {"key": key, "label": label})
    return study


__all__ = ["INPUTS_ATTR", "check_study", "claim_study", "open_storage", "safe_url"]
