"""Benchmark scripts (not tests): each prints measured time beside a floor and an alternative."""
