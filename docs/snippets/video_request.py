request = ot.GenerationRequest(
    prompt="a boat crossing a bay", num_steps=4, height=32, width=32,
    num_frames=9,         # None (the default) asks for an image
)
output = await engine.generate(request)
assert output.video.shape == (1, 9, 3, 32, 32)  # CPU float32 [N, F, C, H, W] in [0, 1]
assert output.images.shape == (1, 3, 32, 32)    # its first frames, output.video[:, 0]
output.save_video("boat.mp4", fps=16)           # H.264 MP4; needs PyAV: omni_trio[video]
