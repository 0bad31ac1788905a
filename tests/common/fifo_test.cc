// Fifo (src/common/fifo.h) and RecyclingMap (src/common/recycling_map.h): order through growth
// and wrap-around, values let go when popped or erased, nodes reused.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/fifo.h"
#include "common/recycling_map.h"

namespace fabric {
namespace {

TEST(Fifo, KeepsOrderThroughGrowthAndWrapAround) {
  Fifo<std::string> q;
  EXPECT_TRUE(q.empty());
  int next_in = 0;
  int next_out = 0;
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < round % 37; ++i) q.push_back(std::to_string(next_in++));
    for (int i = 0; i < round % 23 && !q.empty(); ++i) {
      ASSERT_EQ(q.front(), std::to_string(next_out++));
      q.pop_front();
    }
  }
  EXPECT_EQ(q.size(), static_cast<size_t>(next_in - next_out));
  while (!q.empty()) {
    ASSERT_EQ(q.front(), std::to_string(next_out++));
    q.pop_front();
  }
  EXPECT_EQ(next_out, next_in);
}

TEST(Fifo, PopAndClearLetGoOfValues) {
  auto value = std::make_shared<int>(1);
  Fifo<std::shared_ptr<int>> q;
  q.push_back(value);
  q.push_back(value);
  EXPECT_EQ(value.use_count(), 3);
  q.pop_front();
  EXPECT_EQ(value.use_count(), 2);
  q.clear();
  EXPECT_EQ(value.use_count(), 1);
  EXPECT_TRUE(q.empty());
}

TEST(RecyclingMap, PutFindEraseAndReplace) {
  RecyclingMap<int, std::shared_ptr<int>> m(4);
  auto v = std::make_shared<int>(7);
  for (int k = 0; k < 6; ++k) m.put(k, v);
  EXPECT_EQ(m.size(), 6u);
  EXPECT_EQ(v.use_count(), 7);
  m.put(3, std::make_shared<int>(8));  // replaces
  EXPECT_EQ(*m.find(3)->second, 8);
  EXPECT_EQ(v.use_count(), 6);
  EXPECT_TRUE(m.erase(0));
  EXPECT_FALSE(m.erase(0));
  EXPECT_EQ(v.use_count(), 5) << "an erased value was kept alive in its spare node";
  for (auto it = m.begin(); it != m.end();) it = m.erase(it);
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(v.use_count(), 1);
  m.put(42, v);  // from a spare node
  EXPECT_EQ(m.find(42)->second, v);
  EXPECT_EQ(m.find(1), m.end());
}

}  // namespace
}  // namespace fabric
