#include "report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string_view>

namespace fabric::bench {

namespace {

std::string num(double v, int decimals) {
  if (std::isnan(v) || std::isinf(v)) return "-";
  return fmt::format("{:.{}f}", v, decimals);
}

// a / b, or NaN when either is missing.
double ratio(double a, double b) {
  if (std::isnan(a) || std::isnan(b) || b <= 0) return std::nan("");
  return a / b;
}

// A table of strings: the first column left-aligned, the others right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  void add(std::vector<std::string> cells) {
    cells.resize(headers_.size());
    rows_.push_back(std::move(cells));
  }
  std::string render(bool markdown) const {
    std::vector<size_t> width(headers_.size());
    for (size_t c = 0; c < headers_.size(); ++c) {
      width[c] = headers_[c].size();
      for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
    }
    auto line = [&](const std::vector<std::string>& cells) {
      std::string out = markdown ? "|" : " ";
      for (size_t c = 0; c < cells.size(); ++c) {
        out += c == 0 ? fmt::format(" {:<{}} ", cells[c], width[c])
                      : fmt::format(" {:>{}} ", cells[c], width[c]);
        if (markdown) out += "|";
      }
      while (!markdown && !out.empty() && out.back() == ' ') out.pop_back();
      return out + "\n";
    };
    std::string out = line(headers_);
    if (markdown) {
      out += "|";
      for (size_t c = 0; c < headers_.size(); ++c) {
        out += c == 0 ? ":" + std::string(width[c] + 1, '-') + "|"
                      : std::string(width[c] + 1, '-') + ":|";
      }
      out += "\n";
    }
    for (const auto& r : rows_) out += line(r);
    return out;
  }

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

const std::vector<BaselineFigure>& runs_of(const RowReport& r, const char* name) {
  static const std::vector<BaselineFigure> kNone;
  auto it = r.baselines.find(name);
  return it == r.baselines.end() ? kNone : it->second;
}

std::string verified(const RowReport& r) {
  return r.error.empty() ? "yes" : "FAILED";
}

// `s` as a JSON string literal, quotes included.
std::string json_string(std::string_view s) {
  return nlohmann::json(std::string(s))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string json_num(double v) {
  if (std::isnan(v) || std::isinf(v)) return "null";
  return fmt::format("{:.6g}", v);
}

uint64_t row_bytes(const Row& r) {
  switch (r.op) {
    case Op::kSingle:
    case Op::kScatter:
    case Op::kRead:
    case Op::kReadRtt:
      return r.bytes;
    case Op::kPaged:
    case Op::kPagedRead:
      return r.page_bytes * r.pages;
    default:
      return 0;
  }
}

}  // namespace

Summary summarize(const RowReport& r) {
  Summary s;
  if (!r.error.empty()) {
    s.error = r.error;
    return s;
  }
  std::vector<double> gbps, mops, post, cpu, lat, wake, sleep, sys, csw;
  for (const PassResult& p : r.passes) {
    if (p.seconds <= 0) continue;
    if (p.bytes > 0) {
      gbps.push_back(static_cast<double>(p.bytes) * 8 / p.seconds / 1e9);
      cpu.push_back(p.cpu_seconds / (static_cast<double>(p.bytes) / kGiB));
    }
    mops.push_back(static_cast<double>(p.ops) / p.seconds / 1e6);
    post.push_back(p.post_us);
    if (!std::isnan(p.wakeups_per_op)) wake.push_back(p.wakeups_per_op);
    if (!std::isnan(p.sleeps_per_op)) sleep.push_back(p.sleeps_per_op);
    if (!std::isnan(p.syscalls_per_op)) sys.push_back(p.syscalls_per_op);
    if (!std::isnan(p.switches_per_op)) csw.push_back(p.switches_per_op);
    lat.insert(lat.end(), p.lat_us.begin(), p.lat_us.end());
  }
  s.wakeups_per_op = median(wake);
  s.sleeps_per_op = median(sleep);
  s.syscalls_per_op = median(sys);
  s.switches_per_op = median(csw);
  s.gbps = median(gbps);
  s.mops = median(mops);
  s.post_us = median(post);
  s.cpu_s_per_gib = median(cpu);
  s.p50_us = percentile(lat, 50);
  s.p99_us = percentile(lat, 99);
  s.runs = r.passes.size();
  return s;
}

Summary summarize(const std::vector<BaselineFigure>& runs) {
  Summary s;
  std::vector<double> gbps, mops, p50, p99, post, cpu;
  for (const BaselineFigure& f : runs) {
    if (!f.ok()) {
      s.error = f.error;
      continue;
    }
    gbps.push_back(f.gbps);
    mops.push_back(f.mops);
    p50.push_back(f.p50_us);
    p99.push_back(f.p99_us);
    post.push_back(f.post_us);
    cpu.push_back(f.cpu_s_per_gib);
    ++s.runs;
  }
  if (s.runs > 0) s.error.clear();
  s.gbps = median(gbps);
  s.mops = median(mops);
  s.p50_us = median(p50);
  s.p99_us = median(p99);
  s.post_us = median(post);
  s.cpu_s_per_gib = median(cpu);
  return s;
}

std::string render_tables(const RunInfo& info, const std::vector<RowReport>& rows, bool markdown) {
  std::string out;
  auto title = [&](const std::string& t) {
    out += markdown ? fmt::format("\n### {}\n\n", t) : fmt::format("\n{}\n", t);
  };
  if (markdown) {
    out += fmt::format("## fabric-bench: provider {} on {}\n\n", info.provider, info.host);
    out += fmt::format("`{}` ({}; {} CPUs; NICs {})\n\n", info.command, info.date, info.cpus,
                       info.nics);
  } else {
    out += fmt::format("fabric-bench: provider {}, NIC(s) {}, host {} ({} CPUs)\n", info.provider,
                       info.nics, info.host, info.cpus);
  }
  out += fmt::format(
      "{} timed pass(es) per row after {} warm-up pass(es), ours interleaved with the "
      "baselines; medians. Window {} transfers; up to {} per pass. Every pass verified.\n",
      info.iters, info.warmup, info.budget.window, human_bytes(info.budget.pass_bytes));

  std::vector<const RowReport*> single, paged, imm, scatter, barrier, read, paged_read, read_rtt;
  for (const RowReport& r : rows) {
    switch (r.row.op) {
      case Op::kSingle:
        single.push_back(&r);
        break;
      case Op::kPaged:
        paged.push_back(&r);
        break;
      case Op::kImm:
        imm.push_back(&r);
        break;
      case Op::kScatter:
        scatter.push_back(&r);
        break;
      case Op::kBarrier:
        barrier.push_back(&r);
        break;
      case Op::kRead:
        read.push_back(&r);
        break;
      case Op::kPagedRead:
        paged_read.push_back(&r);
        break;
      case Op::kReadRtt:
        read_rtt.push_back(&r);
        break;
    }
  }

  if (!single.empty()) {
    title("single writes with an immediate");
    Table t({"size", "Gbps", "Mops", "p50 us", "p99 us", "post us", "wake/op", "sleep/op", "sys/op",
             "csw/op", "CPU s/GiB", "raw Gbps", "UCX put", "UCX tag", "ours/raw", "ours/UCX put",
             "verified"});
    for (const RowReport* r : single) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      const Summary put = summarize(runs_of(*r, kUcxPut));
      const Summary tag = summarize(runs_of(*r, kUcxTag));
      t.add({human_bytes(r->row.bytes), num(s.gbps, 2), num(s.mops, 3), num(s.p50_us, 1),
             num(s.p99_us, 1), num(s.post_us, 2), num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3),
             num(s.syscalls_per_op, 2), num(s.switches_per_op, 3), num(s.cpu_s_per_gib, 2),
             num(raw.gbps, 2), num(put.gbps, 2), num(tag.gbps, 2), num(ratio(s.gbps, raw.gbps), 2),
             num(ratio(s.gbps, put.gbps), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!paged.empty()) {
    title("paged writes (random page indices, stride = page + 128 B, one immediate per page)");
    Table t({"page", "pages", "Gbps", "Mpages/s", "p50 us", "p99 us", "post us", "wake/op",
             "sleep/op", "sys/op", "csw/op", "CPU s/GiB", "raw Gbps", "UCX put", "ours/raw",
             "ours/UCX put", "verified"});
    for (const RowReport* r : paged) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      const Summary put = summarize(runs_of(*r, kUcxPut));
      t.add({human_bytes(r->row.page_bytes), std::to_string(r->row.pages), num(s.gbps, 2),
             num(s.mops, 3), num(s.p50_us, 0), num(s.p99_us, 0), num(s.post_us, 2),
             num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3), num(s.syscalls_per_op, 2),
             num(s.switches_per_op, 3), num(s.cpu_s_per_gib, 2), num(raw.gbps, 2), num(put.gbps, 2),
             num(ratio(s.gbps, raw.gbps), 2), num(ratio(s.gbps, put.gbps), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!imm.empty()) {
    title("imm-only writes: round trips one at a time, message rate with the window in flight");
    Table t({"op", "Mops", "RTT p50 us", "RTT p99 us", "post us", "wake/op", "sleep/op", "sys/op",
             "csw/op", "raw Mops", "raw p50", "raw p99", "UCX tag Mops", "UCX tag p50",
             "ours/raw Mops", "ours/raw p50", "verified"});
    for (const RowReport* r : imm) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      const Summary tag = summarize(runs_of(*r, kUcxTag));
      t.add({"imm", num(s.mops, 3), num(s.p50_us, 1), num(s.p99_us, 1), num(s.post_us, 2),
             num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3), num(s.syscalls_per_op, 2),
             num(s.switches_per_op, 3), num(raw.mops, 3), num(raw.p50_us, 1), num(raw.p99_us, 1),
             num(tag.mops, 3), num(tag.p50_us, 1), num(ratio(s.mops, raw.mops), 2),
             num(ratio(s.p50_us, raw.p50_us), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!scatter.empty()) {
    title("scatter: one source to N peers, one immediate per target");
    Table t({"per target", "peers", "Gbps", "Mops", "p50 us", "p99 us", "post us", "wake/op",
             "sleep/op", "sys/op", "csw/op", "CPU s/GiB", "verified"});
    for (const RowReport* r : scatter) {
      const Summary s = summarize(*r);
      t.add({human_bytes(r->row.bytes), std::to_string(r->row.peers), num(s.gbps, 2),
             num(s.mops, 3), num(s.p50_us, 1), num(s.p99_us, 1), num(s.post_us, 2),
             num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3), num(s.syscalls_per_op, 2),
             num(s.switches_per_op, 3), num(s.cpu_s_per_gib, 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!barrier.empty()) {
    title("barrier: imm-only write to N peers, each answering; until all answers are in");
    Table t({"op", "peers", "rounds/s", "p50 us", "p99 us", "post us", "verified"});
    for (const RowReport* r : barrier) {
      const Summary s = summarize(*r);
      t.add({"barrier", std::to_string(r->row.peers), num(s.mops * 1e6, 0), num(s.p50_us, 1),
             num(s.p99_us, 1), num(s.post_us, 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!read.empty()) {
    title("single reads (the owner's code takes no part; no immediate)");
    Table t({"size", "Gbps", "Mops", "p50 us", "p99 us", "post us", "wake/op", "sleep/op", "sys/op",
             "csw/op", "CPU s/GiB", "raw Gbps", "ours/raw", "verified"});
    for (const RowReport* r : read) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      t.add({human_bytes(r->row.bytes), num(s.gbps, 2), num(s.mops, 3), num(s.p50_us, 1),
             num(s.p99_us, 1), num(s.post_us, 2), num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3),
             num(s.syscalls_per_op, 2), num(s.switches_per_op, 3), num(s.cpu_s_per_gib, 2),
             num(raw.gbps, 2), num(ratio(s.gbps, raw.gbps), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!paged_read.empty()) {
    title("paged reads (random page indices, stride = page + 128 B)");
    Table t({"page", "pages", "Gbps", "Mpages/s", "p50 us", "p99 us", "post us", "wake/op",
             "sleep/op", "sys/op", "csw/op", "CPU s/GiB", "raw Gbps", "ours/raw", "verified"});
    for (const RowReport* r : paged_read) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      t.add({human_bytes(r->row.page_bytes), std::to_string(r->row.pages), num(s.gbps, 2),
             num(s.mops, 3), num(s.p50_us, 0), num(s.p99_us, 0), num(s.post_us, 2),
             num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3), num(s.syscalls_per_op, 2),
             num(s.switches_per_op, 3), num(s.cpu_s_per_gib, 2), num(raw.gbps, 2),
             num(ratio(s.gbps, raw.gbps), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!read_rtt.empty()) {
    title("read round trips: one read at a time (the request to the owner, the data back)");
    Table t({"size", "RTT p50 us", "RTT p99 us", "post us", "wake/op", "sleep/op", "sys/op",
             "csw/op", "raw p50", "raw p99", "ours/raw p50", "verified"});
    for (const RowReport* r : read_rtt) {
      const Summary s = summarize(*r);
      const Summary raw = summarize(runs_of(*r, kRaw));
      t.add({human_bytes(r->row.bytes), num(s.p50_us, 1), num(s.p99_us, 1), num(s.post_us, 2),
             num(s.wakeups_per_op, 3), num(s.sleeps_per_op, 3), num(s.syscalls_per_op, 2),
             num(s.switches_per_op, 3), num(raw.p50_us, 1), num(raw.p99_us, 1),
             num(ratio(s.p50_us, raw.p50_us), 2), verified(*r)});
    }
    out += t.render(markdown);
  }
  if (!info.iperf3.empty()) {
    const Summary ip = summarize(info.iperf3);
    out += fmt::format("\niperf3, one TCP stream over loopback: {} Gbps (median of {}){}\n",
                       num(ip.gbps, 2), ip.runs, ip.error.empty() ? "" : "; " + ip.error);
  }

  std::vector<std::string> notes = info.notes;
  for (const RowReport& r : rows) {
    if (!r.error.empty()) notes.push_back(fmt::format("{}: {}", r.row.label(), r.error));
    for (const auto& [name, runs] : r.baselines) {
      const Summary b = summarize(runs);
      if (b.runs == 0 && !b.error.empty()) {
        notes.push_back(fmt::format("{} baseline {}: {}", r.row.label(), name, b.error));
      }
    }
  }
  out += fmt::format(
      "\nGbps: payload bits/s; Mops: million writes (pages, messages, barrier rounds) per "
      "second; p50/p99: submit() to done callback per transfer with the window in flight (imm, "
      "barrier: round trips); post us: client time inside submit() per work request; wake/op, "
      "sleep/op: "
      "times a submission woke the client's worker (one eventfd write each) and times it slept, "
      "per op (TransferEngine::stats()); sys/op, csw/op: system calls and context switches of "
      "the whole client process (every thread: submitter, worker, callbacks) per op, counted "
      "by the kernel (perf_event_open; n/a without it, and sys/op without tracefs); CPU "
      "s/GiB: CPU time of the client and its peers in the timed phase. raw: fabric-bench-raw "
      "(bare libfabric, same provider, same write size; paged: one write per page, "
      "contiguous); UCX put/tag: ucx_perftest ucp_put_bw / tag_bw (imm row: tag_bw and "
      "tag_lat, 8 B). Ratios: ours / baseline (imm: Mops, and RTT p50 where above 1 is "
      "slower).\n");
  if (!read.empty() || !paged_read.empty() || !read_rtt.empty()) {
    out +=
        "Reads: the client reads the peer's memory (registered remote_read) into its own; "
        "p50/p99 and Mops as for writes, per read (paged: per page). raw: fabric-bench-raw's "
        "fi_read of the same size, the same window (paged: one read per page, contiguous); "
        "read round trips: one read at a time, submit() to done callback, against raw's "
        "fi_read one at a time (ours/raw p50: above 1 is slower).\n";
  }
  if (markdown && !notes.empty()) out += "\n";
  for (const std::string& n : notes) out += fmt::format("{}{}\n", markdown ? "- " : "note: ", n);
  return out;
}

std::string render_json(const RunInfo& info, const std::vector<RowReport>& rows) {
  std::string out = "{\n";
  out += fmt::format("  \"provider\": {},\n", json_string(info.provider));
  out += fmt::format("  \"host\": {},\n", json_string(info.host));
  out += fmt::format("  \"cpus\": {},\n", info.cpus);
  out += fmt::format("  \"nics\": {},\n", json_string(info.nics));
  out += fmt::format("  \"date\": {},\n", json_string(info.date));
  out += fmt::format("  \"command\": {},\n", json_string(info.command));
  if (!info.machine_json.empty()) out += fmt::format("  \"machine\": {},\n", info.machine_json);
  out += fmt::format(
      "  \"settings\": {{\"window\": {}, \"pass_bytes\": {}, \"iters\": {}, \"warmup\": {}, "
      "\"quick\": {}}},\n",
      info.budget.window, info.budget.pass_bytes, info.iters, info.warmup,
      info.quick ? "true" : "false");
  out += "  \"results\": [";
  bool first = true;
  for (const RowReport& r : rows) {
    const Summary s = summarize(r);
    out += first ? "\n" : ",\n";
    first = false;
    out += fmt::format(
        "    {{\"op\": {}, \"bytes\": {}, \"page_bytes\": {}, \"pages\": {}, \"peers\": {}, "
        "\"gbps\": {}, \"mops\": {}, \"p50_us\": {}, \"p99_us\": {}, \"post_us\": {}, "
        "\"wakeups_per_op\": {}, \"sleeps_per_op\": {}, \"syscalls_per_op\": {}, "
        "\"switches_per_op\": {}, "
        "\"cpu_s_per_gib\": {}, \"transfers_per_pass\": {}, \"window\": {}, \"passes\": {}, "
        "\"verified\": {}{}}}",
        json_string(op_name(r.row.op)), row_bytes(r.row), r.row.page_bytes, r.row.pages,
        r.row.peers, json_num(s.gbps), json_num(s.mops), json_num(s.p50_us), json_num(s.p99_us),
        json_num(s.post_us), json_num(s.wakeups_per_op), json_num(s.sleeps_per_op),
        json_num(s.syscalls_per_op), json_num(s.switches_per_op), json_num(s.cpu_s_per_gib),
        r.plan.transfers, r.plan.window, s.runs, r.error.empty() ? "true" : "false",
        r.error.empty() ? "" : ", \"error\": " + json_string(r.error));
  }
  out += "\n  ],\n  \"baselines\": [";
  first = true;
  auto baseline = [&](const std::string& name, const Row& row, const Summary& b) {
    out += first ? "\n" : ",\n";
    first = false;
    out += fmt::format(
        "    {{\"name\": {}, \"op\": {}, \"bytes\": {}, \"page_bytes\": {}, \"pages\": {}, "
        "\"gbps\": {}, \"mops\": {}, \"p50_us\": {}, \"p99_us\": {}, \"post_us\": {}, "
        "\"cpu_s_per_gib\": {}, \"runs\": {}{}}}",
        json_string(name), json_string(op_name(row.op)), row_bytes(row), row.page_bytes, row.pages,
        json_num(b.gbps), json_num(b.mops), json_num(b.p50_us), json_num(b.p99_us),
        json_num(b.post_us), json_num(b.cpu_s_per_gib), b.runs,
        b.error.empty() ? "" : ", \"error\": " + json_string(b.error));
  };
  for (const RowReport& r : rows) {
    for (const auto& [name, runs] : r.baselines) baseline(name, r.row, summarize(runs));
  }
  if (!info.iperf3.empty()) {
    out += first ? "\n" : ",\n";
    first = false;
    const Summary ip = summarize(info.iperf3);
    out += fmt::format(
        "    {{\"name\": \"iperf3\", \"op\": \"stream\", \"bytes\": 0, \"gbps\": {}, \"runs\": "
        "{}}}",
        json_num(ip.gbps), ip.runs);
  }
  out += "\n  ]\n}\n";
  return out;
}

}  // namespace fabric::bench
