"""Helpers shared by the tests of every tier: fakes, in-process and subprocess meshes, PKI.

Import them as ``tests.support.<module>``; fixtures that wrap them live in the conftests.
"""
