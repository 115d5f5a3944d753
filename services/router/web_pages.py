"""The router's two pages on its HTTP front: ``GET /``, a chat page that streams from
``/v1/chat/completions``, and ``GET /mesh``, the live mesh from ``/mesh/state``. Each is one
self-contained HTML file (``pages/``), served as it is: it holds no data, so it needs no key;
the key a person types in the page goes with its API calls. The policy below lets a page run
its own inline script and call this origin, nothing else, and never be framed."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse

PAGES = Path(__file__).parent / "pages"
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                      "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


@cache
def _page(name: str) -> str:
    return (PAGES / name).read_text(encoding="utf-8")


async def chat_page(request: Request) -> HTMLResponse:
    return HTMLResponse(_page("chat.html"), headers=HEADERS)


async def mesh_page(request: Request) -> HTMLResponse:
    return HTMLResponse(_page("mesh.html"), headers=HEADERS)
