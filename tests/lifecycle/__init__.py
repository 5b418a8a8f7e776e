"""The lifecycle state machine's parts: the operations (``ops``) and the model (``model``).

The test that runs them is ``tests/test_lifecycle_machine.py``.
"""
