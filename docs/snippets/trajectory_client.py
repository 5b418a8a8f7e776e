import base64

import httpx

import omni_trio as ot

body = {
    "prompt": "a red fox in the snow",
    "n": 4,
    "seed": 2026,
    "sampler": {"kind": "sde", "noise_level": 0.7, "steps": [0, 1, 2]},  # SD: "ddim", "eta"
    "return_trajectory": True,
}
with httpx.Client(base_url="http://127.0.0.1:8000", timeout=600) as client:
    answer = client.post("/v1/images/generations", json=body)
answer.raise_for_status()
trajectory = ot.Trajectory.from_safetensors(
    base64.b64decode(answer.json()["omni_trio"]["trajectory"])
)
print(trajectory.latents.shape, trajectory.log_probs.shape)  # [4, S + 1, ...] [4, 3]
