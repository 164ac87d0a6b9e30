"""The key under which the aiohttp application holds its Server, for every route module."""

from __future__ import annotations

from aiohttp import web

SERVER = web.AppKey("server", object)
