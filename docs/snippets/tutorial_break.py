async with engine.submit(request, request_id="r1") as handle:
    async for event in handle:
        print(event.step, "/", event.total)
        if user_pressed_stop():
            break  # leaves the loop only: r1 keeps running
    output = await handle.result()  # waits for r1's last step and its image
