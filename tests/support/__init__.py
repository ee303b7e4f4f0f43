"""Helpers shared by the unit, component and cluster tests: ports, fake workers, ZMQ taps,
replica clients, metrics, and real child processes (`processes`, `cluster`)."""
