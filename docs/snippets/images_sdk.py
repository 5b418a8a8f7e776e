import base64

import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
result = client.images.generate(model="tiny-sd", prompt="a red flower", n=2, size="64x64",
                                extra_body={"num_inference_steps": 20, "seed": 7})
png = base64.b64decode(result.data[0].b64_json)

for event in client.images.generate(prompt="a red flower", stream=True, partial_images=2):
    print(event.type)   # ...progress (per step), ...partial_image, ...completed
