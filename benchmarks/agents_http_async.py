"""The HTTP calculator's ``async def`` client (benchmarks/agents_http.py has the server and the
synchronous one): asyncio's own streams, so it awaits the server's answer without a thread and
needs no package beyond the standard library (aiohttp is not in every environment the benchmark
runs in)."""

from __future__ import annotations

import asyncio
import urllib.parse

from agents_http import calculate_url


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression to evaluate, e.g. 347 * 29
    """
    url = urllib.parse.urlparse(calculate_url(expression))
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        answer = await reader.read()  # the server closes the connection after its answer
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    if int(head.split()[1]) != 200:  # the calculator's own error, as the local tool raises it
        raise ValueError(body.decode())
    return body.decode()
