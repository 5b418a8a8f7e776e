import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
with open("photo.png", "rb") as image, open("mask.png", "rb") as mask:
    result = client.images.edit(
        image=image, mask=mask, prompt="a red door",
        extra_body={"strength": 0.9, "num_inference_steps": 30, "seed": 1},
    )
