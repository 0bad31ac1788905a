// The discovery API's formatting and parsing (include/fabric/discovery.h), on a machine made
// by hand: a GPU with NICs behind its PCI switch, a verbs port, a path that is not ready.
#include <gtest/gtest.h>

#include <string>

#include "fabric/discovery.h"

namespace fabric {
namespace {

MachineInfo two_nic_gpu_machine() {
  MachineInfo m;
  m.libfabric_version = "1.17";
  m.auto_provider = "tcp";
  m.providers = {{"tcp", {{"eth0", "10.0.0.0/24", "tcp;ofi_rxm", true}}}, {"shm", {}}};
  m.verbs_built = true;
  m.verbs_ports = {{"mlx5_0", 1, "down", false, "Ethernet", 4096, -1, "", "eth0"}};
  m.nics = {{"eth0", "0000:3b:00.0", 0, {0, 1, 2, 3}}, {"mlx5_0", "0000:3b:00.0", 0, {0, 1, 2, 3}}};
  m.gpus = {{"0000:3c:00.0", "nvidia", 0, {0, 1, 2, 3}, {"eth0", "mlx5_0"}, "pci-switch"}};
  m.paths = {{"tcp", "eth0", "tcp;ofi_rxm", "eth0", true, true, true, true},
             {"verbs", "mlx5_0:1", "verbs", "mlx5_0", false, false, false, false}};
  m.allowed_cpus = {0, 1, 2, 3, 8};
  return m;
}

TEST(Discovery, TextNamesGpusTheirNearNicsAndPaths) {
  const std::string text = to_text(two_nic_gpu_machine());
  EXPECT_NE(text.find("0000:3c:00.0"), std::string::npos) << text;
  EXPECT_NE(text.find("near NICs eth0,mlx5_0 (pci-switch)"), std::string::npos) << text;
  EXPECT_NE(text.find("shm    absent"), std::string::npos) << text;
  EXPECT_NE(text.find("not ready"), std::string::npos) << text;
  EXPECT_NE(text.find("CPUs this process may run on: 0-3,8 (5 in all)"), std::string::npos) << text;
  EXPECT_EQ(text.find("TransferEngine on"), std::string::npos) << "no probe, no engine section";
}

TEST(Discovery, JsonHasEveryKeyAndTheEngineProbe) {
  EngineProbe probe;
  probe.requested_provider = "tcp";
  probe.error = "Unsupported: \"quoted\"";
  const std::string json = to_json(two_nic_gpu_machine(), &probe);
  for (const char* key : {"\"libfabric\":\"1.17\"", "\"verbs_built\":true", "\"gpus\":[{",
                          "\"near_nics\":[\"eth0\",\"mlx5_0\"]", "\"nearness\":\"pci-switch\"",
                          "\"paths\":[{", "\"usable\":false", "\"allowed_cpus\":[0,1,2,3,8]",
                          "\"ok\":false", R"("error":"Unsupported: \"quoted\"")"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " in " << json;
  }
  EXPECT_NE(to_json(MachineInfo{}).find("\"engine\":null"), std::string::npos);
}

TEST(Discovery, ParsesCpusAndNamesDefaultNics) {
  EXPECT_EQ(*parse_cpu("auto"), GroupConfig::kCpuAuto);
  EXPECT_EQ(*parse_cpu("none"), GroupConfig::kCpuNone);
  EXPECT_EQ(*parse_cpu("7"), 7);
  for (const char* bad : {"", "-1", "7x", "sometimes"}) {
    auto r = parse_cpu(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_EQ(default_nics("tcp"), std::vector<std::string>{"lo"});
  EXPECT_EQ(default_nics("shm"), std::vector<std::string>{"shm"});
  EXPECT_TRUE(default_nics("efa").empty());
}

TEST(Discovery, FindsThisMachinesCpusAndProviders) {
  const MachineInfo m = discover();
  ASSERT_EQ(m.providers.size(), 4u);
  EXPECT_EQ(m.providers[0].name, "tcp");
  EXPECT_FALSE(m.allowed_cpus.empty());
  for (const PathInfo& p : m.paths) {
    if (p.usable) {
      EXPECT_TRUE(p.writes && p.immediates && p.messages) << p.provider << p.nic;
    }
  }
}

}  // namespace
}  // namespace fabric
