"""Scenarios that mostly wait (the hang tests each wait out a one-minute timeout with their
ranks blocked) start as soon as the session knows it runs them (conftest.py), beside the
other tests, instead of keeping the machine idle for that minute; their fixtures collect the
results here."""

import concurrent.futures

POOL = concurrent.futures.ThreadPoolExecutor(2)
STARTED: dict[str, concurrent.futures.Future] = {}
