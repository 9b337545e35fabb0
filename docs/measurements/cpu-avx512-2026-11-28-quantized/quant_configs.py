import torch
def cfg(which):
    from transformers import TorchAoConfig, BitsAndBytesConfig, QuantoConfig
    if which == "tao_int8wo_fp32":
        from torchao.quantization import Int8WeightOnlyConfig; return TorchAoConfig(Int8WeightOnlyConfig()), torch.float32
    if which == "tao_int8wo_bf16":
        from torchao.quantization import Int8WeightOnlyConfig; return TorchAoConfig(Int8WeightOnlyConfig()), torch.bfloat16
    if which == "tao_int8dyn_fp32":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig; return TorchAoConfig(Int8DynamicActivationInt8WeightConfig()), torch.float32
    if which == "tao_int8dyn_bf16":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig; return TorchAoConfig(Int8DynamicActivationInt8WeightConfig()), torch.bfloat16
    if which == "bnb8_fp32": return BitsAndBytesConfig(load_in_8bit=True), torch.float32
    if which == "bnb4_fp32": return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32), torch.float32
    if which == "bnb4_bf16": return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16), torch.bfloat16
    if which == "quanto8_fp32": return QuantoConfig(weights="int8"), torch.float32
    if which == "quanto8_bf16": return QuantoConfig(weights="int8"), torch.bfloat16
    if which == "none_fp32": return None, torch.float32
    if which == "bnb4_bf16c": return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16), torch.float32
    if which == "none_bf16": return None, torch.bfloat16
