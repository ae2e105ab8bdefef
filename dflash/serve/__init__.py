"""`dflash serve`: an OpenAI-compatible server over the online engine (docs/design.md 4.5).

Needs the `serve` extra (fastapi, uvicorn, pydantic, prometheus_client)."""

from .._optional import require

for _module in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
    require(_module, "serve", "dflash serve")

from .app import Server, build_app  # noqa: E402

__all__ = ["Server", "build_app"]
