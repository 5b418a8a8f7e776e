import omni_trio as ot

request = ot.GenerationRequest(
    prompt="a harbour at dawn", num_steps=10, height=64, width=64, seed=1,
    image=picture,      # PIL RGB, or a CPU float tensor [3, H, W] in [0, 1]
    mask=None,          # PIL L/1, or [1, H, W] in [0, 1]; white (>= 0.5) repaints
    strength=0.6,       # (0, 1]; None: 0.8 for image-to-image, 1.0 for inpainting
)
assert request.kind == "image-to-image"  # "inpaint" with a mask, else "text-to-image"
assert request.denoise_steps == 6        # min(int(num_steps * strength), num_steps)
