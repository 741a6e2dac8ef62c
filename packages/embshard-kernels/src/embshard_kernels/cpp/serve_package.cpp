// Serves an embshard package (embshard_kernels.serving.package_for_serving) without Python.
//
//   serve_package PACKAGE INPUTS OUTPUTS LIBRARY...
//
// Loads each LIBRARY first (FBGEMM's operator libraries, in the order
// embshard_kernels.serving.fbgemm_libraries() lists them), then the package; INPUTS is a file
// written by Python's torch.save of a list of requests, each the list of the model's input
// tensors flattened as the package takes them (for a KeyedJaggedTensor: values, [weights,]
// lengths); OUTPUTS receives the list of each request's flattened outputs, for torch.load.
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: serve_package PACKAGE INPUTS OUTPUTS LIBRARY...\n";
    return 2;
  }
  for (int i = 4; i < argc; ++i) {
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "serve_package: cannot load " << argv[i] << ": " << dlerror() << "\n";
      return 2;
    }
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  c10::InferenceMode inference;
  c10::IValue requests = torch::pickle_load(read_file(argv[2]));
  c10::impl::GenericList replies(c10::AnyType::get());
  for (const c10::IValue& request : requests.toListRef()) {
    std::vector<at::Tensor> inputs;
    for (const c10::IValue& tensor : request.toListRef()) {
      inputs.push_back(tensor.toTensor());
    }
    std::vector<at::Tensor> outputs = loader.run(inputs);
    replies.push_back(c10::IValue(c10::List<at::Tensor>(outputs)));
  }
  std::vector<char> bytes = torch::pickle_save(c10::IValue(replies));
  std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::cout << "served " << requests.toListRef().size() << " requests\n";
  return 0;
}
