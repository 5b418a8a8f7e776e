async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
    busy = engine.submit(req(num_steps=4))
    runner.release(1)
    await runner.wait_arrived(2)     # one step measured; the next waits at the gate
    assume_step_time(engine, 1.0)
    with pytest.raises(ot.DeadlineError):   # the batch is full: 3 left + 2 own > 4.5 s
        engine.submit(req(num_steps=2, deadline_s=4.5))
    runner.open_gate()
    async with busy:
        await busy.result()
