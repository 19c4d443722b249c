"""Test-only references, fixtures and checkpoint builders (importable as ``tests.support``)."""
