view = probe(handle)
engine.abort_nowait("r")
assert view.cancel_reason == "user" and not view.status.is_terminal
runner.release(1)                 # the step ends; the boundary drops the request
await wait_until(lambda: view.status.is_terminal)
assert not view.holds_state
