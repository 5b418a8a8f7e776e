async with engine.submit(request, request_id="r2") as handle:
    async for event in handle:
        print(event.step, "/", event.total)
        if user_pressed_stop():
            await handle.abort()  # r2 stops at its next step boundary, undecoded
            break
print(handle.status)  # RequestStatus.ABORTED
