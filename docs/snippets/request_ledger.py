ledger = RequestLedger()
async with ot.open_engine(runner) as engine:
    async with engine.submit(request) as handle:
        ledger.track(handle)
        async for event in handle:
            ledger.event(handle, event)
        ledger.outcome(handle, await handle.result())
    ledger.check(engine)  # counts equal engine.statistics(); nothing buffered
assert_nothing_left(engine, runner)
