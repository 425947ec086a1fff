// Validates custom resources with the @kubernetes-models validators installed in .tools/crd-models
// (scripts/install_tools.sh). Reads [{apiVersion, kind, metadata, ...}] as JSON on stdin, writes
// [{kind, name, error}] (error null: valid) as JSON on stdout.
// Usage: node crd_validate.mjs MODELS_DIR < objects.json
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

// API group -> the npm package that models it.
const PACKAGES = { "monitoring.coreos.com": "prometheus-operator", "keda.sh": "keda" };

const modelsDir = process.argv[2];
const objects = JSON.parse(readFileSync(0, "utf8"));
const results = [];
for (const object of objects) {
  const [group, version] = object.apiVersion.split("/");
  const name = object.metadata?.name ?? "";
  const pkg = PACKAGES[group];
  if (!pkg) {
    results.push({ kind: object.kind, name, error: `no @kubernetes-models package for ${object.apiVersion}` });
    continue;
  }
  const file = join(modelsDir, "node_modules", "@kubernetes-models", pkg, group, version, `${object.kind}.js`);
  let Model;
  try {
    Model = (await import(pathToFileURL(file).href))[object.kind];
  } catch (e) {
    results.push({ kind: object.kind, name, error: `no model ${file}: ${e.message}` });
    continue;
  }
  try {
    new Model(object).validate();
    results.push({ kind: object.kind, name, error: null });
  } catch (e) {
    results.push({ kind: object.kind, name, error: e.message });
  }
}
process.stdout.write(JSON.stringify(results));
